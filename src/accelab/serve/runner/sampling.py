"""The sampling contract: every engine (continuous torch and llama.cpp steps, the per-batch
generate) hands the [N, V] logits rows of the sequences that pick a token now, with each
sequence's `SequenceSampler`, to `sample`, which returns one `SampledToken` per row.

Per row, in this order (vLLM's and transformers' order):
1. log-probabilities, when asked, from the raw logits (log_softmax before any rule below: what
   the model says, as vLLM's default and transformers' `output_logits` report);
2. logit_bias is added; end-of-sequence and stop tokens are banned before min_tokens (and
   end-of-sequence for ever with ignore_eos);
3. repetition_penalty over the prompt's and the output's tokens (positive logits divided,
   negative multiplied), presence and frequency penalties over the output's counts;
4. the grammar's mask (structured outputs, tool calls): tokens it does not allow are dropped;
   should the bans of 2. leave nothing, the grammar wins (it then only allows end-of-sequence);
5. greedy: the argmax. Sampled: temperature, top_k, top_p, min_p, then a draw with the
   sequence's own torch.Generator, so a seeded request repeats whatever shares its steps.
A batch of plain greedy rows (no rule, no log-probabilities) takes one argmax. Any other batch
takes one path for all its rows, as [N, V] tensors on the logits' device: each rule is one
tensor operation over the batch (`_apply_rules`: the biases and bans put at (row, token) pairs,
the penalties scattered from the rows' token ids, the grammar rows' masks stacked), done only
when some row has it, and a row without it is left exactly as it was; one log_softmax gives the
rows that ask their log-probabilities (`_with_logprobs`). Python touches each row only to
gather its token ids and, for a sampled row, to draw: `_draw` copies the sampled rows'
probabilities to the CPU once and draws each with its own generator (torch.multinomial), so a
seeded request draws the same tokens alone or in a batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from accelab.serve.engines.base import SamplingParams, StepInput

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, kw_only=True, slots=True)
class SampledToken:
    """The token a sequence picked, and (when asked) its log-probability and the alternatives."""

    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()  # (token, log-probability), most likely first


class SequenceSampler:
    """One sequence's sampling state: its rules, random generator, the output's tokens the
    penalties read, and its grammar matcher (an llguidance LLMatcher or anything with the same
    `consume_token` and `allowed(vocab)`; see `accelab.serve.structured`)."""

    def __init__(
        self,
        params: SamplingParams,
        *,
        prompt: Sequence[int] = (),
        eos_ids: Sequence[int] = (),
        grammar: Any = None,
        seed_offset: int = 0,
    ):
        self.params = params
        self.grammar = grammar
        self.generated = 0
        self._output = torch.empty(64, dtype=torch.long)  # [capacity] int64; the tokens are [:generated]
        # the prompt's distinct ids, once (the repetition penalty reads them at every step)
        self._prompt = torch.tensor(sorted(set(prompt)) if params.repetition_penalty != 1.0 else [], dtype=torch.long)
        self._eos = tuple(eos_ids)
        self._stop_ids = tuple(dict.fromkeys((*self._eos, *params.stop_token_ids)))
        self.generator: torch.Generator | None = None
        if not params.greedy:
            self.generator = torch.Generator()
            if params.seed is not None:
                self.generator.manual_seed(params.seed + seed_offset)
            else:
                self.generator.seed()
        p = params
        self.plain = (
            p.greedy
            and grammar is None
            and p.logprobs is None
            and not p.logit_bias
            and not p.ignore_eos
            and p.min_tokens == 0
            and p.repetition_penalty == 1.0
            and p.presence_penalty == 0.0
            and p.frequency_penalty == 0.0
        )

    @property
    def simple(self) -> bool:
        """Samples with the common rules of step 5 only, now: nothing for steps 1-4 to do."""
        p = self.params
        return (
            not p.greedy
            and self.grammar is None
            and p.logprobs is None
            and not p.logit_bias
            and not self.banned()
            and p.repetition_penalty == 1.0
            and p.presence_penalty == 0.0
            and p.frequency_penalty == 0.0
        )

    @property
    def output(self) -> torch.Tensor:
        """[generated] int64 (CPU): the tokens this sequence picked, in order."""
        return self._output[: self.generated]

    @property
    def counts(self) -> dict[int, int]:
        """How often each token came in the output (what the presence and frequency penalties read)."""
        ids, counts = self.output.unique(return_counts=True)
        return dict(zip(ids.tolist(), counts.tolist()))

    def banned(self) -> tuple[int, ...]:
        """Tokens this sequence may not pick now."""
        if self.generated < self.params.min_tokens:
            return self._stop_ids
        return self._eos if self.params.ignore_eos else ()

    def accept(self, token: int) -> None:
        if self.generated == self._output.numel():  # full: double it (amortised O(1) per token)
            self._output = torch.cat([self._output, torch.empty_like(self._output)])
        self._output[self.generated] = token
        self.generated += 1
        if self.grammar is not None:
            self.grammar.consume_token(token)

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [V] -> the processed scores of steps 2-4 (a new float32 tensor): this row alone
        through the batched rules."""
        return _apply_rules(logits[None], [self])[0].clone()

    def pick(self, scores: torch.Tensor) -> int:
        """scores: [V] processed -> the token (step 5): this row alone through the batched pick."""
        return _pick(scores[None], [self])[0]


def sample(logits: torch.Tensor, samplers: Sequence[SequenceSampler]) -> list[SampledToken]:
    """logits: [N, V], one row per sequence that picks a token now -> N SampledTokens; each
    sampler has taken its token (counts, grammar) when this returns."""
    if all(s.plain for s in samplers):
        tokens = _argmax(logits)  # note: a device-to-host sync point
        out = [SampledToken(token=t) for t in tokens]
    else:
        tokens = _pick(_apply_rules(logits, samplers), samplers)
        out = _with_logprobs(logits, tokens, samplers)
    for s, token in zip(samplers, tokens):
        s.accept(token)
    return out


def _apply_rules(logits: torch.Tensor, samplers: Sequence[SequenceSampler]) -> torch.Tensor:
    """logits: [n, V] -> the processed scores of steps 2-4: [n, V] float32 on logits' device, to
    read only (with no rule to apply and finite float32 logits, the logits themselves). Each
    rule is one batched operation over the (row, token) pairs it touches, skipped when no row has
    it; the pairs are built on the CPU and copied to the device once."""
    vocab = logits.shape[1]
    bias = [(i, t, b) for i, s in enumerate(samplers) for t, b in s.params.logit_bias if 0 <= t < vocab]
    bans = [(i, t) for i, s in enumerate(samplers) for t in s.banned() if 0 <= t < vocab]
    repeated = [i for i, s in enumerate(samplers) if s.params.repetition_penalty != 1.0]
    counted = [
        i for i, s in enumerate(samplers) if s.generated and (s.params.presence_penalty or s.params.frequency_penalty)
    ]
    ruled = [i for i, s in enumerate(samplers) if s.grammar is not None]
    if not (bias or bans or repeated or counted or ruled):
        return _finite(logits.float())
    scores = logits.to(torch.float32, copy=True)
    # 2. biases added at their (row, token), then the bans
    if bias:
        at, ids, values = _on(logits.device, *zip(*bias))
        scores.index_put_((at, ids), values, accumulate=True)
    if bans:
        at, ids = _on(logits.device, *zip(*bans))
        scores.index_put_((at, ids), torch.tensor(float("-inf"), device=logits.device))
    # 3. the penalties, 4. the grammar's masks
    if repeated:
        _repetition(scores, samplers, repeated)
    if counted:
        _presence_and_frequency(scores, samplers, counted)
    if ruled:
        scores = _grammar(scores, logits, samplers, ruled)
    return _finite(scores)


def _repetition(scores: torch.Tensor, samplers: Sequence[SequenceSampler], rows: Sequence[int]) -> None:
    """In place: the rows' repetition penalty over their prompt's and output's tokens (a token
    seen twice is the same value written twice)."""
    at, ids = _pairs(rows, [torch.cat([samplers[i]._prompt, samplers[i].output]) for i in rows], scores.shape[1])
    penalty = torch.tensor([s.params.repetition_penalty for s in samplers])[at]
    at, ids, penalty = _on(scores.device, at, ids, penalty)
    seen = scores[at, ids]
    scores.index_put_((at, ids), torch.where(seen > 0, seen / penalty, seen * penalty))


def _presence_and_frequency(scores: torch.Tensor, samplers: Sequence[SequenceSampler], rows: Sequence[int]) -> None:
    """In place: the rows' presence and frequency penalties over their output's counts."""
    vocab = scores.shape[1]
    at, ids = _pairs(rows, [samplers[i].output for i in rows], vocab)
    pairs, counts = (at * vocab + ids).unique(return_counts=True)  # one per distinct (row, token)
    at, ids = pairs // vocab, pairs % vocab
    presence = torch.tensor([s.params.presence_penalty for s in samplers])[at]
    penalty = presence + torch.tensor([s.params.frequency_penalty for s in samplers])[at] * counts.float()
    at, ids, penalty = _on(scores.device, at, ids, penalty)
    scores.index_put_((at, ids), scores[at, ids] - penalty)


def _grammar(
    scores: torch.Tensor, logits: torch.Tensor, samplers: Sequence[SequenceSampler], rows: Sequence[int]
) -> torch.Tensor:
    """The grammar rows' allowed masks, stacked: what they do not allow is dropped. Should the
    bans have left a row nothing (+inf counts as nothing too), its grammar wins over the raw logits."""
    (allowed,) = _on(scores.device, torch.stack([samplers[i].grammar.allowed(scores.shape[1]).cpu() for i in rows]))
    masked = _take(scores, rows).masked_fill_(~allowed, float("-inf"))  # [g, V]
    lost = ((masked - masked) != 0).all(dim=-1)  # [g]: no finite score (x - x is 0 when finite, else NaN)
    if bool(lost.any()):  # note: a sync point
        raw = _take(logits, rows).float().masked_fill(~allowed, float("-inf"))
        masked = torch.where(lost[:, None], raw, masked)
    if len(rows) == scores.shape[0]:
        return masked
    scores[_on(scores.device, rows)] = masked
    return scores


def _pairs(rows: Sequence[int], ids: Sequence[torch.Tensor], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """rows' token ids (CPU int64 tensors) -> (row, token) index tensors, [m] each, of the ids
    inside the vocabulary."""
    at = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long), torch.tensor([len(t) for t in ids]))
    flat = torch.cat(list(ids))
    keep = (flat >= 0) & (flat < vocab)
    return at[keep], flat[keep]


def _take(t: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """t[rows] (a copy), or t itself when rows are all of its rows, in order."""
    return t if list(rows) == list(range(t.shape[0])) else t[list(rows)]


def _on(device: torch.device, *values: Any) -> tuple[torch.Tensor, ...]:
    """Index and value lists or CPU tensors -> tensors on the device. non_blocking: a copy from
    pageable memory is staged at once, without waiting for the device's queued work."""
    return tuple(torch.as_tensor(v).to(device, non_blocking=True) for v in values)


def _column(values: Sequence[float], device: torch.device) -> torch.Tensor:
    """One float32 value per row, [n, 1]: a Python float rounded as a float32 scalar would be."""
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]


def _pick(scores: torch.Tensor, samplers: Sequence[SequenceSampler]) -> list[int]:
    """scores: [n, V] processed -> one token per row (step 5): the greedy rows' argmax, the
    others drawn from `_probabilities`."""
    greedy = [i for i, s in enumerate(samplers) if s.params.greedy]
    drawn = [i for i, s in enumerate(samplers) if not s.params.greedy]
    tokens = [0] * len(samplers)
    if greedy:
        for i, token in zip(greedy, _argmax(_take(scores, greedy))):  # note: a sync point
            tokens[i] = token
    if drawn:
        probs = _probabilities(_take(scores, drawn), [samplers[i].params for i in drawn])
        for i, token in zip(drawn, _draw(probs, [samplers[i].generator for i in drawn])):
            tokens[i] = token
    return tokens


def _probabilities(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """scores: [n, V] processed, of sampled rows -> [n, V] probabilities (unnormalised after
    top_p and min_p) after each row's temperature, top_k, top_p and min_p; a row without a rule
    is left as it was (its k 0: a -inf threshold, its top_p 1: a cut at +inf, its min_p 0)."""
    vocab = scores.shape[1]
    device = scores.device
    scores = scores / _column([p.temperature for p in params], device)
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        top = scores.topk(max(ks), dim=-1).values  # [n, k]
        kth = top.gather(1, torch.tensor([[max(k, 1) - 1] for k in ks], device=device))
        kth = torch.where(torch.tensor([[k > 0] for k in ks], device=device), kth, float("-inf"))
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if any(p.top_p < 1.0 for p in params):
        # a token is dropped when those ranked above it hold top_p of the mass (rows at 1.0 drop none)
        cut = _column([p.top_p if p.top_p < 1.0 else float("inf") for p in params], device)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= cut
        drop[:, 0] = False  # the most likely token stays, however small top_p is
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(drop, 0.0))
    if any(p.min_p > 0.0 for p in params):
        floor = _column([p.min_p for p in params], device) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


def _argmax(scores: torch.Tensor) -> list[int]:
    """Each row's index of its first highest score, NaN never picked (`_finite`): one `max` pass
    where no row holds NaN or +inf (`argmax` over bf16 logits [16, 49152] took 1.44 ms here,
    `max` 0.31, and `_finite` first read them once more)."""
    if not scores.numel():
        return [0] * scores.shape[0]
    peaks, index = scores.max(dim=-1)
    top = float(peaks.max())
    if top == top and top != float("inf"):
        return index.tolist()
    return _finite(scores).max(dim=-1).indices.tolist()


def _finite(scores: torch.Tensor) -> torch.Tensor:
    """scores [n, V] a draw can take whatever arrived: NaN is never picked (-inf), and a row with
    +inf scores picks among those tokens only (they are infinitely more likely than the rest)."""
    peak = float(scores.max()) if scores.numel() else 0.0  # NaN if any: one pass (note: a sync point)
    if peak == peak and peak != float("inf"):  # -inf may stay: nothing picks it
        return scores
    scores = scores.nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    top = scores == float("inf")
    return torch.where(top.any(dim=-1, keepdim=True), torch.where(top, 0.0, float("-inf")), scores)


def _draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> list[int]:
    """probs: [n, V] (unnormalised is fine) -> one token per row, drawn with the row's own
    generator (torch.multinomial: the draw seeded requests have always repeated with). A row with
    no mass left (every token banned) takes the most likely of what is left. The generators
    live on the CPU: the rows come there in one copy (note: a device-to-host sync point)."""
    probs = probs.cpu()
    total = probs.sum(dim=-1)
    out = []
    for row, generator, mass in zip(probs, generators, total.tolist()):
        if not mass > 0 or mass != mass or mass == float("inf"):
            out.append(int(row.nan_to_num(nan=-1.0).argmax()))
        else:
            out.append(int(torch.multinomial(row, 1, generator=generator)))
    return out


def _with_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], samplers: Sequence[SequenceSampler]
) -> list[SampledToken]:
    """Step 1 for the rows that ask: one log_softmax of their raw logits, the picked tokens'
    values and each row's `logprobs` alternatives (the top k of the largest k asked)."""
    out = [SampledToken(token=t) for t in tokens]
    asked = [i for i, s in enumerate(samplers) if s.params.logprobs is not None]
    if not asked:
        return out
    logprobs = torch.log_softmax(_take(logits, asked).float(), dim=-1)  # [m, V]
    picked = torch.tensor([[tokens[i]] for i in asked], device=logits.device)
    chosen = logprobs.gather(1, picked)[:, 0].tolist()
    k = min(max(samplers[i].params.logprobs or 0 for i in asked), logprobs.shape[1])
    best = logprobs.topk(k, dim=-1)
    ids, values = best.indices.tolist(), best.values.tolist()
    for j, i in enumerate(asked):
        top = samplers[i].params.logprobs or 0
        out[i] = SampledToken(token=tokens[i], logprob=chosen[j], top=tuple(zip(ids[j][:top], values[j][:top])))
    return out


def sample_step(logits: torch.Tensor, inputs: Sequence[StepInput], eos_ids: Sequence[int] = ()) -> list[SampledToken]:
    """What a StepEngine's step calls: logits [N, V] of its inputs that sample, in order. An
    input without a sampler (a start-up check) gets a fresh one from its params."""
    samplers = [
        item.sampler if item.sampler is not None else SequenceSampler(item.params, eos_ids=eos_ids) for item in inputs
    ]
    return sample(logits, samplers)
