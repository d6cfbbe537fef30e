"""When a sequence is done, at the level of tokens: the one rule every generation path applies
(the continuous scheduler, the per-batch `generate` and the engine-process worker), so a
request ends the same way whichever engine runs it.

A sampled token ends its sequence with "stop" when it is an end-of-sequence or stop token and
more than `min_tokens` tokens were generated (the sampler bans them before that), else with
"length" when it is the `max_tokens`-th. With `ignore_eos` the end-of-sequence ids do not end
it (the stop token ids still do). Stop strings are text: the text stream matches them
(`accelab.serve.textstream`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

FinishReason = Literal["stop", "length"]

__all__ = ["FinishReason", "StopRules"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StopRules:
    max_tokens: int
    min_tokens: int = 0
    end_ids: frozenset[int] = frozenset()  # end-of-sequence and stop token ids

    @classmethod
    def of(cls, params: Any, eos_ids: Sequence[int] = ()) -> StopRules:
        """The rules of a request's SamplingParams, on a model whose end-of-sequence ids are `eos_ids`."""
        ends = (() if params.ignore_eos else tuple(eos_ids)) + tuple(params.stop_token_ids)
        return cls(max_tokens=params.max_tokens, min_tokens=params.min_tokens, end_ids=frozenset(ends))

    def check(self, generated: int, token: int) -> FinishReason | None:
        """Why a sequence that has just generated its `generated`-th token, `token`, ends; None: it goes on."""
        if token in self.end_ids and generated > self.min_tokens:
            return "stop"
        if generated >= self.max_tokens:
            return "length"
        return None
