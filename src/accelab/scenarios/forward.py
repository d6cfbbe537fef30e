"""The forward scenario: one batch through the model, timed in a loop. Its metric keys are
`accelab.results.contract.FORWARD`.

It runs in parts so that plans can take turns (`accelab.benchmark.rounds`): `warm` once, then
`round` as often as the driver asks (each a short timed loop), then `metrics` over the rounds
the driver kept. `run_forward` is the one-round composition.
"""

from __future__ import annotations

from typing import Any

import torch

from accelab.measure.stats import LoopTiming, capped_samples, summarize, timed_loop
from accelab.plan.runtime import Runnable
from accelab.results import contract as K
from accelab.scenarios.timing import call_timer
from accelab.scenarios.workload import RoundSpec, Workload


class ForwardScenario:
    def __init__(self, runnable: Runnable, batch: dict[str, torch.Tensor], workload: Workload) -> None:
        self.runnable, self.batch, self.workload = runnable, batch, workload
        self._timer = call_timer(runnable.device)
        self.warmup_seconds: list[float] = []

    def _call(self) -> Any:
        return self.runnable.forward(self.batch)

    def warm(self) -> list[float]:
        """The excluded calls; the first is always one of them: it may compile."""
        self.warmup_seconds = [self._timer(self._call) for _ in range(max(self.workload.warmup, 1))]
        return self.warmup_seconds

    def round(self, spec: RoundSpec) -> LoopTiming:
        return timed_loop(
            self._call,
            warmup=0,
            min_iters=spec.min_iters,
            min_seconds=spec.min_seconds,
            max_seconds=spec.max_seconds,
            measure=self._timer,
        )

    def rate(self, timing: LoopTiming) -> float:
        """Items per second of one round (the figure rounds are compared by)."""
        return self.workload.batch_size * timing.iterations / timing.wall_seconds

    def metrics(self, rounds: list[LoopTiming]) -> dict[str, Any]:
        """Latency distribution and throughput (items / wall time) over the given rounds."""
        if not rounds:
            raise ValueError("forward metrics need at least one timed round")
        batch_size = self.workload.batch_size  # final: the command resolved it (see resolve_batch_size)
        durations = [s for timing in rounds for s in timing.durations]
        wall = sum(timing.wall_seconds for timing in rounds)
        latency = summarize([s * 1000 for s in durations])
        first_call_s = self.warmup_seconds[0] if self.warmup_seconds else 0.0
        return {
            K.LATENCY_MS: latency.to_dict(),
            K.LATENCY_SAMPLES_MS: capped_samples([s * 1000 for s in durations]),
            K.ITERATIONS: len(durations),
            K.TIMED_SECONDS: wall,
            K.ITEMS_PER_CALL: batch_size,
            K.THROUGHPUT: batch_size * len(durations) / wall,
            K.THROUGHPUT_UNIT: K.FORWARD.key(K.THROUGHPUT).unit,
            K.FIRST_CALL_S: first_call_s,
            # the first call pays compilation / lazy init; what it took beyond a steady call
            K.FIRST_CALL_OVERHEAD_S: max(first_call_s - latency.p50 / 1000, 0.0),
        }


def run_forward(runnable: Runnable, batch: dict[str, torch.Tensor], workload: Workload) -> dict[str, Any]:
    """Warm up, one timed loop of the whole workload, its metrics."""
    scenario = ForwardScenario(runnable, batch, workload)
    scenario.warm()
    return scenario.metrics([scenario.round(RoundSpec.whole(workload))])
