"""The forward scenario: one batch through the model, timed in a loop."""

from __future__ import annotations

from typing import Any

import torch

from accelab.measure.stats import capped_samples, summarize, timed_loop
from accelab.plan.runtime import Runnable
from accelab.scenarios.timing import call_timer
from accelab.scenarios.workload import Workload


def run_forward(runnable: Runnable, batch: dict[str, torch.Tensor], workload: Workload, batch_size: int) -> dict[str, Any]:
    """Latency distribution and throughput (items / wall time of the timed loop)."""
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
        "latency_ms": latency.to_dict(),
        "latency_samples_ms": capped_samples([s * 1000 for s in timing.durations]),
        "iterations": timing.iterations,
        "timed_seconds": timing.wall_seconds,
        "items_per_call": batch_size,
        "throughput": batch_size * timing.iterations / timing.wall_seconds,
        "throughput_unit": "items/s",
        "first_call_s": first_call_s,
        # the first call pays compilation / lazy init; what it took beyond a steady call
        "first_call_overhead_s": max(first_call_s - latency.p50 / 1000, 0.0),
    }
