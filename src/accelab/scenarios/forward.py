"""The forward scenario: one batch through the model, timed in a loop. Its metric keys are
`accelab.results.contract.FORWARD`."""

from __future__ import annotations

from typing import Any

import torch

from accelab.measure.stats import capped_samples, summarize, timed_loop
from accelab.plan.runtime import Runnable
from accelab.results import contract as K
from accelab.scenarios.timing import call_timer
from accelab.scenarios.workload import Workload


def run_forward(runnable: Runnable, batch: dict[str, torch.Tensor], workload: Workload) -> dict[str, Any]:
    """Latency distribution and throughput (items / wall time of the timed loop)."""
    batch_size = workload.batch_size  # final: the command resolved it (see resolve_batch_size)
    timing = timed_loop(
        lambda: runnable.forward(batch),
        warmup=max(workload.warmup, 1),  # the first call is always excluded: it may compile
        min_iters=workload.min_iters,
        min_seconds=workload.min_seconds,
        max_seconds=workload.max_seconds,
        measure=call_timer(runnable.device),
    )
    latency = summarize([s * 1000 for s in timing.durations])
    first_call_s = timing.warmup_seconds[0]
    return {
        K.LATENCY_MS: latency.to_dict(),
        K.LATENCY_SAMPLES_MS: capped_samples([s * 1000 for s in timing.durations]),
        K.ITERATIONS: timing.iterations,
        K.TIMED_SECONDS: timing.wall_seconds,
        K.ITEMS_PER_CALL: batch_size,
        K.THROUGHPUT: batch_size * timing.iterations / timing.wall_seconds,
        K.THROUGHPUT_UNIT: K.FORWARD.key(K.THROUGHPUT).unit,
        K.FIRST_CALL_S: first_call_s,
        # the first call pays compilation / lazy init; what it took beyond a steady call
        K.FIRST_CALL_OVERHEAD_S: max(first_call_s - latency.p50 / 1000, 0.0),
    }
