"""The rows of one per-batch `generate` call (accelab.serve.engines.generation): each row has its
own max_tokens, stop strings and sampling rules.

- `RowTracker` (a StoppingCriteria, called once per decoding step with every row's new token)
  feeds each row's TextStream, hands new text to the row's unit and tells generate which rows
  are done; generate runs until all are (max_new_tokens is the largest request's).
- `RowSampler` (a LogitsProcessor) has each row's SequenceSampler pick its token with the rules
  every engine shares (`runner.sampling`: penalties, logit_bias, grammar masks, logprobs, ...)
  and leaves only that token finite, so generate's own pick takes it. A batch of plain greedy
  rows without logprobs runs plain greedy search.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from accelab.serve.engines.base import Completion, GenUnit
from accelab.serve.engines.delivery import completion, deliver
from accelab.serve.runner.sampling import SampledToken, SequenceSampler, sample
from accelab.serve.stops import StopRules
from accelab.serve.textstream import TextStream


class RowTracker:
    """Per-row bookkeeping during one generate call (a StoppingCriteria in all but name: it
    follows the protocol, __call__(input_ids, scores) -> bool tensor [B])."""

    def __init__(self, units: list[GenUnit], streams: list[TextStream], rules: list[StopRules], *, decode: Any = None):
        self.units = units
        self.streams = streams
        self.rules = rules
        self.decode = decode
        self.finished_at: list[float | None] = [None] * len(units)
        self.sampled: list[SampledToken | None] = [None] * len(units)  # the row's token of this step

    def live(self, row: int) -> bool:
        return self.streams[row].finish_reason is None and not self.units[row].cancelled

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        tokens = input_ids[:, -1].tolist()  # note: a CPU-GPU sync point, once per step
        now = time.monotonic()
        done = []
        for row, (unit, stream, rules, token) in enumerate(zip(self.units, self.streams, self.rules, tokens)):
            if stream.finish_reason is None and not unit.cancelled:
                ends = rules.check(stream.tokens + 1, token)
                step = deliver(unit, stream, token, ends=ends, now=now, sampled=self.sampled[row])
                if step.finished:
                    self.finished_at[row] = now
            done.append(stream.finish_reason is not None or unit.cancelled)
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    def completions(self) -> list[Completion]:
        out = []
        for row, (unit, stream) in enumerate(zip(self.units, self.streams)):
            if stream.finish_reason is None:  # generate stopped on its own (cancelled, max length)
                unit.emit(stream.end().text)
            finished_at = self.finished_at[row] or time.monotonic()
            out.append(completion(unit, stream, finished_at=finished_at, decode=self.decode))
        return out


class RowSampler:
    """A LogitsProcessor: every live row's SequenceSampler picks its token (runner.sampling);
    the scores that go back are -inf but at that token, so generate's pick (argmax, or a draw
    from one finite score) takes exactly it. Finished rows keep their argmax (padding follows)."""

    def __init__(self, samplers: list[SequenceSampler], tracker: RowTracker):
        self.samplers = samplers
        self.tracker = tracker

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        # scores: [B, V] float32, the raw logits of this step (no processor ran before this one)
        live = [row for row in range(scores.shape[0]) if self.tracker.live(row)]
        tokens = scores.argmax(dim=-1)
        picked = sample(scores[live], [self.samplers[row] for row in live]) if live else []
        for row, token in zip(live, picked):
            tokens[row] = token.token
            self.tracker.sampled[row] = token
        forced = torch.full_like(scores, float("-inf"))
        forced.scatter_(1, tokens[:, None], 0.0)
        return forced


def sampling_kwargs(samplers: list[SequenceSampler], tracker: RowTracker) -> dict[str, Any]:
    """generate's sampling options for these rows: plain greedy search, or RowSampler's picks."""
    if all(s.plain for s in samplers):
        return {"do_sample": False}
    from transformers import LogitsProcessorList

    # generate's own warpers are switched off: RowSampler applies every rule per row
    return {
        "do_sample": True,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "logits_processor": LogitsProcessorList([RowSampler(samplers, tracker)]),
    }
