"""The generate scenario: greedy decoding of exactly `new_tokens` tokens per sequence.

TTFT is the time to the first new token (prefill + one sampling step), TPOT the mean time per
later token, ITL the distribution of gaps between tokens. A fresh `TokenClock` is made for every
call, so the bookkeeping never carries over between calls. Its metric keys are
`accelab.results.contract.GENERATE`.

Like the forward scenario it runs in parts (`warm`, `round` as often as the driver asks,
`metrics` over the kept rounds); `run_generate` is the one-round composition.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from accelab.measure.stats import capped_samples, summarize
from accelab.plan.runtime import Runnable
from accelab.results import contract as K
from accelab.scenarios.timing import synchronizer
from accelab.scenarios.workload import RoundSpec, Workload


class TokenClock(StoppingCriteria):
    """Records the time each decoding step produced its tokens; never stops generation.

    transformers calls stopping criteria once per step, right after the step's tokens are
    appended, so the first timestamp marks the first token.
    """

    def __init__(self, sync: Callable[[], None], clock: Callable[[], float] = time.perf_counter):
        self.sync = sync
        self.clock = clock
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.sync()  # note: a CPU-GPU sync point per token, so the timestamp is the token's
        self.times.append(self.clock())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def generate_once(
    runnable: Runnable, batch: dict[str, torch.Tensor], new_tokens: int
) -> tuple[Any, float, list[float]]:
    """One timed generate call: (output ids, start time, per-token timestamps)."""
    sync = synchronizer(runnable.device)
    token_clock = TokenClock(sync)
    sync()
    start = time.perf_counter()
    output = runnable.generate(
        batch,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        stopping_criteria=StoppingCriteriaList([token_clock]),
    )
    sync()
    end = time.perf_counter()
    return output, start, token_clock.times or [end]


@dataclass(kw_only=True, slots=True)
class GenerateRound:
    """The timed calls of one round (seconds)."""

    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    wall_seconds: float = 0.0

    @property
    def iterations(self) -> int:
        return len(self.e2e)

    @property
    def durations(self) -> list[float]:
        return self.e2e


class GenerateScenario:
    def __init__(self, runnable: Runnable, batch: dict[str, torch.Tensor], workload: Workload) -> None:
        self.runnable, self.batch, self.workload = runnable, batch, workload
        self.warmup_seconds: list[float] = []
        self.output: Any = None

    def warm(self) -> list[float]:
        """The excluded calls; the first is always one of them: it may compile."""
        for _ in range(max(self.workload.warmup, 1)):
            self.output, start, stamps = generate_once(self.runnable, self.batch, self.workload.new_tokens)
            self.warmup_seconds.append(stamps[-1] - start)
        return self.warmup_seconds

    def round(self, spec: RoundSpec) -> GenerateRound:
        timed = GenerateRound()
        loop_start = time.perf_counter()
        while True:
            self.output, start, stamps = generate_once(self.runnable, self.batch, self.workload.new_tokens)
            timed.ttft.append(stamps[0] - start)
            gaps = [b - a for a, b in zip(stamps, stamps[1:])]
            timed.itl.extend(gaps)
            if gaps:
                timed.tpot.append(sum(gaps) / len(gaps))
            timed.e2e.append(stamps[-1] - start)
            elapsed = time.perf_counter() - loop_start
            if (timed.iterations >= spec.min_iters and elapsed >= spec.min_seconds) or elapsed >= spec.max_seconds:
                break
        timed.wall_seconds = time.perf_counter() - loop_start
        return timed

    def rate(self, timed: GenerateRound) -> float:
        """New tokens of all sequences per second of one round (the figure rounds are compared by)."""
        return self.workload.batch_size * self.workload.new_tokens * timed.iterations / timed.wall_seconds

    def metrics(self, rounds: list[GenerateRound]) -> dict[str, Any]:
        if not rounds:
            raise ValueError("generate metrics need at least one timed round")
        n, batch_size = self.workload.new_tokens, self.workload.batch_size
        ttft = [t for r in rounds for t in r.ttft]
        tpot = [t for r in rounds for t in r.tpot]
        itl = [t for r in rounds for t in r.itl]
        e2e = [t for r in rounds for t in r.e2e]
        wall = sum(r.wall_seconds for r in rounds)
        first_call_s = self.warmup_seconds[0] if self.warmup_seconds else 0.0
        output = self.output
        prompt_len = self.batch["input_ids"].shape[1]
        produced = output[:, prompt_len:] if torch.is_tensor(output) else None
        tokens_per_call = batch_size * n
        decode_seconds = sum(t * (n - 1) for t in tpot)
        metrics: dict[str, Any] = {
            K.TTFT_MS: summarize([t * 1000 for t in ttft]).to_dict(),
            K.E2E_MS: summarize([t * 1000 for t in e2e]).to_dict(),
            K.LATENCY_SAMPLES_MS: capped_samples([t * 1000 for t in e2e]),
            K.ITERATIONS: len(e2e),
            K.TIMED_SECONDS: wall,
            K.NEW_TOKENS: n,
            K.PROMPT_TOKENS: int(prompt_len),
            K.ITEMS_PER_CALL: batch_size,
            # tokens of all sequences over the wall time of the timed loop (prefill included)
            K.THROUGHPUT: tokens_per_call * len(e2e) / wall,
            K.THROUGHPUT_UNIT: K.GENERATE.key(K.THROUGHPUT).unit,
            K.REQUESTS_PER_S: batch_size * len(e2e) / wall,
            K.FIRST_CALL_S: first_call_s,
            K.FIRST_CALL_OVERHEAD_S: max(first_call_s - sum(e2e) / len(e2e), 0.0),
        }
        if tpot:
            metrics[K.TPOT_MS] = summarize([t * 1000 for t in tpot]).to_dict()
            metrics[K.ITL_MS] = summarize([t * 1000 for t in itl]).to_dict()
            # decode-only rate: tokens after the first, over the time spent producing them
            metrics[K.DECODE_TOKENS_PER_S] = batch_size * (n - 1) * len(tpot) / decode_seconds
            metrics[K.DECODE_STEP_S] = sum(tpot) / len(tpot)
        if produced is not None and produced.shape[1] != n:
            raise RuntimeError(f"generate produced {produced.shape[1]} tokens, asked for exactly {n}")
        metrics[K.GENERATED_TOKENS_CHECKED] = produced is not None
        metrics[K.SAMPLE_TEXT] = _decode_first(self.runnable, produced)
        return metrics


def run_generate(runnable: Runnable, batch: dict[str, torch.Tensor], workload: Workload) -> dict[str, Any]:
    """Warm up, one timed loop of the whole workload, its metrics."""
    scenario = GenerateScenario(runnable, batch, workload)
    scenario.warm()
    return scenario.metrics([scenario.round(RoundSpec.whole(workload))])


def _decode_first(runnable: Runnable, produced: torch.Tensor | None) -> str | None:
    if produced is None:
        return None
    tokenizer = getattr(runnable.processor, "tokenizer", runnable.processor)
    if not hasattr(tokenizer, "decode"):
        return None
    return tokenizer.decode(produced[0], skip_special_tokens=True)
