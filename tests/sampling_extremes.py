"""Sampling values the schema allows that once answered 500, and what each engine must answer
(shared by the torch and llama.cpp server tests)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# schemathesis sent top_p 5e-324: a denormal, read as 0.0 where the parsing thread flushes
# denormals to zero (a 422 then); 1e-300 is as small for float32 and parses everywhere
EXTREMES = [
    {"top_p": 1e-300, "temperature": 1.0, "seed": 1},
    {"repetition_penalty": 0.01, "temperature": 1.0, "seed": 1},
    {"temperature": 1e-300},
    {"temperature": 2.0, "top_p": 1e-300, "repetition_penalty": 0.01, "presence_penalty": 2.0, "seed": 2},
]


def check_extreme(chat: Callable[..., dict], text: Callable[[dict], str], url: str, extreme: dict[str, Any]) -> None:
    """A temperature below 1e-5 is greedy (vLLM's rule), a tiny top_p keeps the most likely token,
    and a repetition penalty below 0.01 is outside the schema: a 422 naming the field."""
    greedy = text(chat(url, max_tokens=8))
    reply = chat(url, max_tokens=8, **extreme)
    assert reply["choices"][0]["finish_reason"] in ("stop", "length") and reply["usage"]["completion_tokens"] >= 1
    if extreme.get("temperature") == 1e-300 or extreme.get("top_p") == 1e-300 and "repetition_penalty" not in extreme:
        assert text(reply) == greedy  # one token left to pick at every step: the greedy one
    refused = chat(url, 422, max_tokens=8, repetition_penalty=5e-324)  # outside the schema: its 422
    assert refused["error"]["param"] == "repetition_penalty"
