"""Sampling values the schema allows that once answered 500, and what each engine must answer
(shared by the torch and llama.cpp server tests)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# schemathesis sent top_p 5e-324: a denormal, read as 0.0 where the parsing thread flushes
# denormals to zero (a 422 then); 1e-300 is as small for float32 and parses everywhere
EXTREMES = [
    {"top_p": 1e-300, "temperature": 2.0, "seed": 1},  # at top_p 1 this seed leaves the greedy path
    {"repetition_penalty": 0.01, "temperature": 1.0, "seed": 1},
    {"temperature": 1e-300},
    {"temperature": 2.0, "top_p": 1e-300, "repetition_penalty": 0.01, "presence_penalty": 2.0, "seed": 2},
]


def check_extreme(
    chat: Callable[..., dict], url: str, extreme: dict[str, Any], *, text: Callable[[dict], str] | None = None
) -> None:
    """A temperature below 1e-5 is greedy (vLLM's rule), a tiny top_p keeps the most likely token,
    and a repetition penalty below 0.01 is outside the schema: a 422 naming the field.

    "The most likely token" is read from the reply's own logprobs, not from a second, greedy request:
    a second request may find its prompt in a prefix cache and compute the last prompt token in a
    batch of another shape, which moves the logits by float rounding and can flip a near tie. An
    engine without logprobs (`text` given: vLLM's, no prefix cache) is compared with a greedy reply."""
    greedy_only = extreme.get("temperature") == 1e-300 or (
        extreme.get("top_p") == 1e-300 and "repetition_penalty" not in extreme
    )
    asked = {"logprobs": True, "top_logprobs": 3} if greedy_only and text is None else {}
    greedy = text(chat(url, max_tokens=8)) if greedy_only and text is not None else None
    reply = chat(url, max_tokens=8, **extreme, **asked)
    assert reply["choices"][0]["finish_reason"] in ("stop", "length") and reply["usage"]["completion_tokens"] >= 1
    if greedy is not None and text is not None:
        assert text(reply) == greedy
    elif greedy_only:  # one token left to pick at every step: the most likely one
        steps = reply["choices"][0]["logprobs"]["content"]
        assert 1 <= len(steps) <= reply["usage"]["completion_tokens"]  # a stop token may count, unshown
        for step in steps:
            best = max(alternative["logprob"] for alternative in step["top_logprobs"])
            assert step["logprob"] >= best - 1e-4, (step["token"], step["top_logprobs"])
    refused = chat(url, 422, max_tokens=8, repetition_penalty=5e-324)  # outside the schema: its 422
    assert refused["error"]["param"] == "repetition_penalty"
