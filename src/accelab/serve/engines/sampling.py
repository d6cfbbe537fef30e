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
Rows with plain greedy rules and no log-probabilities take one batched argmax; rows that sample
with the common rules only (temperature, top_k, top_p, min_p; no bias, bans, penalties, grammar
or log-probabilities) are processed together as one [n, V] tensor (`_sample_rows`), each still
drawing with its own generator (`_draw`), so a seeded request draws the same tokens alone or in a
batch.
The rest go row by row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, overload

import torch

from accelab.serve.engines.base import SamplingParams, StepInput, TokenLogprob

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, kw_only=True, slots=True)
class SampledToken:
    """The token a sequence picked, and (when asked) its log-probability and the alternatives."""

    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()  # (token, log-probability), most likely first


class SequenceSampler:
    """One sequence's sampling state: its rules, random generator, the counts the penalties
    read, and its grammar matcher (an llguidance LLMatcher or anything with the same
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
        self.counts: dict[int, int] = {}
        self._prompt = tuple(prompt) if params.repetition_penalty != 1.0 else ()
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
        """Samples with the common rules only, now: `_sample_rows` can take it with others."""
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

    def banned(self) -> tuple[int, ...]:
        """Tokens this sequence may not pick now."""
        if self.generated < self.params.min_tokens:
            return self._stop_ids
        return self._eos if self.params.ignore_eos else ()

    def accept(self, token: int) -> None:
        self.generated += 1
        self.counts[token] = self.counts.get(token, 0) + 1
        if self.grammar is not None:
            self.grammar.consume_token(token)

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [V] -> the processed scores of steps 2-4 (a new float32 tensor)."""
        p = self.params
        scores = logits.float().clone()
        vocab = scores.shape[0]
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias if t < vocab], dtype=torch.long)
            scores.index_add_(0, ids, torch.tensor([b for t, b in p.logit_bias if t < vocab], dtype=scores.dtype))
        banned = [t for t in self.banned() if t < vocab]
        if banned:
            scores[banned] = float("-inf")
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(self._prompt) | set(self.counts)), dtype=torch.long)
            if seen.numel():
                picked = scores[seen]
                scores[seen] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and self.counts:
            ids = torch.tensor(list(self.counts), dtype=torch.long)
            counts = torch.tensor(list(self.counts.values()), dtype=scores.dtype)
            scores[ids] -= p.presence_penalty + p.frequency_penalty * counts
        if self.grammar is not None:
            allowed = self.grammar.allowed(vocab)  # [V] bool
            masked = scores.masked_fill(~allowed, float("-inf"))
            if not bool(torch.isfinite(masked).any()):  # the bans left nothing: the grammar wins
                masked = logits.float().masked_fill(~allowed, float("-inf"))
            scores = masked
        return _finite(scores[None])[0]

    def pick(self, scores: torch.Tensor) -> int:
        """scores: [V] processed -> the token (step 5)."""
        p = self.params
        if p.greedy:
            return int(scores.argmax())
        scores = scores / p.temperature
        if 0 < p.top_k < scores.shape[0]:
            kth = scores.topk(p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # drop a token when the tokens ranked above it already hold top_p of the mass
            drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= p.top_p
            drop[0] = False  # the most likely token stays, however small top_p is
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs.masked_fill(drop, 0.0))
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        return _draw(probs[None], [self.generator])[0]


def sample(logits: torch.Tensor, samplers: Sequence[SequenceSampler]) -> list[SampledToken]:
    """logits: [N, V], one row per sequence that picks a token now -> N SampledTokens; each
    sampler has taken its token (counts, grammar) when this returns."""
    if all(s.plain for s in samplers):
        tokens = _finite(logits).argmax(dim=-1).tolist()  # note: a device-to-host sync point
        for s, token in zip(samplers, tokens):
            s.accept(token)
        return [SampledToken(token=t) for t in tokens]
    rows = logits.float().cpu() if logits.device.type != "cpu" else logits
    out: list[SampledToken | None] = [None] * len(samplers)
    greedy = [i for i, s in enumerate(samplers) if s.plain]
    simple = [i for i, s in enumerate(samplers) if not s.plain and s.simple]
    if greedy:
        for i, token in zip(greedy, _finite(rows[greedy]).argmax(dim=-1).tolist()):
            out[i] = SampledToken(token=token)
    if simple:
        for i, token in zip(simple, _sample_rows(rows[simple], [samplers[i] for i in simple])):
            out[i] = SampledToken(token=token)
    for i, s in enumerate(samplers):
        if out[i] is None:
            token = s.pick(s.scores(rows[i]))
            out[i] = _with_logprobs(rows[i], token, s.params.logprobs)
    for s, picked in zip(samplers, out):
        assert picked is not None
        s.accept(picked.token)
    return [picked for picked in out if picked is not None]


def _sample_rows(logits: torch.Tensor, samplers: Sequence[SequenceSampler]) -> list[int]:
    """logits: [n, V] of rows that sample with the common rules only -> one token each: what
    `SequenceSampler.pick` computes row by row, as batched tensor operations, then each row's
    draw with its own generator."""
    vocab = logits.shape[1]
    params = [s.params for s in samplers]
    scores = _finite(logits.float()) / torch.tensor([[p.temperature] for p in params])
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        top = scores.topk(max(ks), dim=-1).values  # [n, k]
        kth = top.gather(1, torch.tensor([[max(k, 1) - 1] for k in ks]))
        kth = torch.where(torch.tensor([[k > 0] for k in ks]), kth, float("-inf"))
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if any(p.top_p < 1.0 for p in params):
        # a token is dropped when those ranked above it hold top_p of the mass (rows at 1.0 drop none)
        cut = torch.tensor([[p.top_p if p.top_p < 1.0 else float("inf")] for p in params])
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= cut
        drop[:, 0] = False  # the most likely token stays, however small top_p is
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(drop, 0.0))
    if any(p.min_p > 0.0 for p in params):
        floor = torch.tensor([[p.min_p] for p in params]) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    return _draw(probs, [s.generator for s in samplers])


def _finite(scores: torch.Tensor) -> torch.Tensor:
    """scores [n, V] a draw can take whatever arrived: NaN is never picked (-inf), and a row with
    +inf scores picks among those tokens only (they are infinitely more likely than the rest)."""
    if bool(torch.isfinite(scores).all()):
        return scores
    scores = scores.nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    top = scores == float("inf")
    return torch.where(top.any(dim=-1, keepdim=True), torch.where(top, 0.0, float("-inf")), scores)


def _draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> list[int]:
    """probs: [n, V] (unnormalised is fine) -> one token per row, drawn with the row's own
    generator (torch.multinomial: the draw seeded requests have always repeated with). A row with
    no mass left (every token banned) takes the most likely of what is left."""
    total = probs.sum(dim=-1)
    out = []
    for row, generator, mass in zip(probs, generators, total.tolist()):
        if not mass > 0 or mass != mass or mass == float("inf"):
            out.append(int(row.nan_to_num(nan=-1.0).argmax()))
        else:
            out.append(int(torch.multinomial(row, 1, generator=generator)))
    return out


def sample_step(logits: torch.Tensor, inputs: Sequence[StepInput], eos_ids: Sequence[int] = ()) -> list[SampledToken]:
    """What a StepEngine's step calls: logits [N, V] of its inputs that sample, in order. An
    input without a sampler (a start-up check) gets a fresh one from its params."""
    samplers = [
        item.sampler if item.sampler is not None else SequenceSampler(item.params, eos_ids=eos_ids) for item in inputs
    ]
    return sample(logits, samplers)


def _with_logprobs(logits: torch.Tensor, token: int, top: int | None) -> SampledToken:
    if top is None:
        return SampledToken(token=token)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    best = logprobs.topk(top) if top else None
    alternatives = () if best is None else tuple(zip(best.indices.tolist(), best.values.tolist()))
    return SampledToken(token=token, logprob=float(logprobs[token]), top=alternatives)


def prompt_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[SampledToken | None]:
    """logits: [L, V] of every prompt position -> per prompt token its log-probability given
    the tokens before it (the first has none: logprob None) and the `top` alternatives."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [L, V]
    out: list[SampledToken | None] = [SampledToken(token=tokens[0])]  # no logprob: nothing comes before it
    ids = torch.tensor(tokens[1:], dtype=torch.long)
    if not len(ids):
        return out
    chosen = logprobs[:-1].gather(1, ids[:, None])[:, 0].tolist()
    best = logprobs[:-1].topk(top, dim=-1) if top else None
    for i, (token, value) in enumerate(zip(ids.tolist(), chosen)):
        alternatives = () if best is None else tuple(zip(best.indices[i].tolist(), best.values[i].tolist()))
        out.append(SampledToken(token=token, logprob=value, top=alternatives))
    return out


@overload
def describe(tokens: Sequence[SampledToken], decode: Callable[[list[int]], str]) -> tuple[TokenLogprob, ...]: ...


@overload  # a prompt's: its first token has none (nothing before it to predict it)
def describe(
    tokens: Sequence[SampledToken | None], decode: Callable[[list[int]], str]
) -> tuple[TokenLogprob | None, ...]: ...


def describe(
    tokens: Sequence[SampledToken | None], decode: Callable[[list[int]], str]
) -> tuple[TokenLogprob | None, ...]:
    """SampledTokens as text for the response (each token and alternative decoded alone)."""
    cache: dict[int, str] = {}

    def text(token: int) -> str:
        if token not in cache:
            cache[token] = decode([token])
        return cache[token]

    return tuple(
        None
        if t is None
        else TokenLogprob(token=text(t.token), logprob=t.logprob, top=tuple((text(a), v) for a, v in t.top))
        for t in tokens
    )
