"""Sampling a batch where every row has rules: the batched path (`runner.sampling.sample`)
against the per-row path it replaced (kept below, as it was at commit 0904288: each row with a
rule through `scores` and `pick` alone, the common-rule rows through `_sample_rows`).

Each row of the batch has every rule: logit_bias, a min_tokens ban of end-of-sequence,
repetition (over a 512-token prompt and the output), presence and frequency penalties (the
output starts 256 tokens long), a grammar mask (a fixed half of the vocabulary), 5
log-probabilities; even rows sample (temperature, top_k, top_p, min_p, a seed), odd rows are
greedy. First both paths run twin samplers side by side on the CPU and must pick the same
tokens with the same log-probabilities; then both are timed, alternating call by call (median
of --iters calls each, after 3 warm-up calls), at 1, 8 and 16 rows over a 49152-token
vocabulary, the logits on --device (with cuda the old path copies them to the CPU first).

    python benchmarks/sampling_batch.py [--vocab 49152] [--iters 30] [--threads 2] [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from accelab.serve.engines.base import SamplingParams
from accelab.serve.runner import sampling
from accelab.serve.runner.sampling import SampledToken, SequenceSampler

EOS = 2


class FixedGrammar:
    """A FAKE matcher (benchmark only): the same allowed mask at every step."""

    def __init__(self, allowed: torch.Tensor):
        self.mask = allowed

    def allowed(self, vocab: int) -> torch.Tensor:
        return self.mask[:vocab]

    def consume_token(self, token: int) -> None:
        pass


def samplers(n: int, vocab: int) -> list[SequenceSampler]:
    g = torch.Generator().manual_seed(n)
    allowed = torch.rand(vocab, generator=g) < 0.5
    allowed[EOS] = True
    out = []
    for row in range(n):
        sampled = row % 2 == 0
        params = SamplingParams(
            max_tokens=4096,
            min_tokens=2048,
            logit_bias=((5, 3.0), (17 + row, -2.0), (vocab - 1, 1.5)),
            repetition_penalty=1.1,
            presence_penalty=0.3,
            frequency_penalty=0.2,
            logprobs=5,
            temperature=0.8 if sampled else 0.0,
            top_k=50 if sampled else 0,
            top_p=0.9 if sampled else 1.0,
            min_p=0.05 if sampled else 0.0,
            seed=row if sampled else None,
        )
        prompt = torch.randint(vocab, (512,), generator=g).tolist()
        s = SequenceSampler(params, prompt=prompt, eos_ids=(EOS,), grammar=FixedGrammar(allowed))
        for token in torch.randint(vocab, (256,), generator=g).tolist():
            s.accept(token)
        out.append(s)
    return out


# -- the per-row path before the batched one (commit 0904288), reading the same samplers --------


def old_scores(s: SequenceSampler, logits: torch.Tensor) -> torch.Tensor:
    p = s.params
    scores = logits.float().clone()
    vocab = scores.shape[0]
    counts_of = s.counts
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias if t < vocab], dtype=torch.long)
        scores.index_add_(0, ids, torch.tensor([b for t, b in p.logit_bias if t < vocab], dtype=scores.dtype))
    banned = [t for t in s.banned() if t < vocab]
    if banned:
        scores[banned] = float("-inf")
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(s._prompt.tolist()) | set(counts_of)), dtype=torch.long)
        if seen.numel():
            picked = scores[seen]
            scores[seen] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and counts_of:
        ids = torch.tensor(list(counts_of), dtype=torch.long)
        counts = torch.tensor(list(counts_of.values()), dtype=scores.dtype)
        scores[ids] -= p.presence_penalty + p.frequency_penalty * counts
    if s.grammar is not None:
        allowed = s.grammar.allowed(vocab)
        masked = scores.masked_fill(~allowed, float("-inf"))
        if not bool(torch.isfinite(masked).any()):
            masked = logits.float().masked_fill(~allowed, float("-inf"))
        scores = masked
    return sampling._finite(scores[None])[0]


def old_pick(s: SequenceSampler, scores: torch.Tensor) -> int:
    p = s.params
    if p.greedy:
        return int(scores.argmax())
    scores = scores / p.temperature
    if 0 < p.top_k < scores.shape[0]:
        kth = scores.topk(p.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= p.top_p
        drop[0] = False
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs.masked_fill(drop, 0.0))
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return sampling._draw(probs[None], [s.generator])[0]


def old_with_logprobs(logits: torch.Tensor, token: int, top: int | None) -> SampledToken:
    if top is None:
        return SampledToken(token=token)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    best = logprobs.topk(top) if top else None
    alternatives = () if best is None else tuple(zip(best.indices.tolist(), best.values.tolist()))
    return SampledToken(token=token, logprob=float(logprobs[token]), top=alternatives)


def old_sample(logits: torch.Tensor, samplers: Sequence[SequenceSampler]) -> list[SampledToken]:
    if all(s.plain for s in samplers):
        return sampling.sample(logits, samplers)
    rows = logits.float().cpu() if logits.device.type != "cpu" else logits
    out: list[SampledToken | None] = [None] * len(samplers)
    greedy = [i for i, s in enumerate(samplers) if s.plain]
    simple = [i for i, s in enumerate(samplers) if not s.plain and s.simple]
    if greedy:
        for i, token in zip(greedy, sampling._finite(rows[greedy]).argmax(dim=-1).tolist()):
            out[i] = SampledToken(token=token)
    if simple:
        scores = sampling._finite(rows[simple].float())
        probs = sampling._probabilities(scores, [samplers[i].params for i in simple])
        for i, token in zip(simple, sampling._draw(probs, [samplers[i].generator for i in simple])):
            out[i] = SampledToken(token=token)
    for i, s in enumerate(samplers):
        if out[i] is None:
            out[i] = old_with_logprobs(rows[i], old_pick(s, old_scores(s, rows[i])), s.params.logprobs)
    for s, picked in zip(samplers, out):
        assert picked is not None
        s.accept(picked.token)
    return [picked for picked in out if picked is not None]


# -- the check and the timing ------------------------------------------------------------------


def check(vocab: int, rows: int, steps: int) -> float:
    """Twin samplers through both paths, step after step: the same tokens, and the largest
    difference between their log-probabilities (alternatives included)."""
    old, new = samplers(rows, vocab), samplers(rows, vocab)
    g = torch.Generator().manual_seed(1)
    worst = 0.0
    for step in range(steps):
        logits = torch.randn(rows, vocab, generator=g) * 4
        before, after = old_sample(logits, old), sampling.sample(logits, new)
        for a, b in zip(before, after):
            if a.token != b.token or [t for t, _ in a.top] != [t for t, _ in b.top]:
                raise SystemExit(f"step {step}: the old path picked {a}, the new one {b}")
            assert a.logprob is not None and b.logprob is not None
            worst = max(worst, abs(a.logprob - b.logprob), *(abs(x - y) for (_, x), (_, y) in zip(a.top, b.top)))
    return worst


def medians_ms(rows: int, vocab: int, iters: int, device: str) -> tuple[float, float]:
    """The old and the new path's median time for one call, alternating (old, new, old, ...)
    so that the load of a shared machine hits both alike."""
    paths: list[Callable[[torch.Tensor, list[SequenceSampler]], object]] = [old_sample, sampling.sample]
    batches = [samplers(rows, vocab), samplers(rows, vocab)]
    logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(2)) * 4).to(device)
    times: list[list[float]] = [[], []]
    for i in range(3 + iters):
        for path, batch, spent in zip(paths, batches, times):
            t0 = time.perf_counter()
            path(logits, batch)
            if i >= 3:  # the first 3: warm-up
                spent.append(time.perf_counter() - t0)
    old, new = (statistics.median(t) * 1000 for t in times)
    return old, new


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--device", default="cpu", help="where the logits are (cuda: the old path copies them to the CPU)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    worst = check(args.vocab, rows=8, steps=5)
    print(f"old and new paths: the same tokens for 8 rows x 5 steps; logprobs differ by at most {worst:.2e}")
    print(f"vocab {args.vocab}, every rule on every row, logits on {args.device}, {args.threads} CPU threads, ", end="")
    print(f"median of {args.iters}")
    print(f"{'rows':>4}  {'old ms':>8}  {'new ms':>8}  {'old/new':>7}")
    for rows in (1, 8, 16):
        old, new = medians_ms(rows, args.vocab, args.iters, args.device)
        print(f"{rows:>4}  {old:>8.2f}  {new:>8.2f}  {old / new:>7.2f}")


if __name__ == "__main__":
    main()
