"""Summary statistics and the timed loop. Pure: no torch, the clock is injected."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class Stats:
    """Distribution of one measured quantity, in its own unit (milliseconds for latencies)."""

    n: int
    mean: float
    stdev: float
    cv: float  # coefficient of variation, stdev / mean
    min: float
    p50: float
    p90: float
    p99: float
    max: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), on pre-sorted values."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q={q} must be within 0..100")
    pos = (len(sorted_values) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(values: list[float]) -> Stats:
    if not values:
        raise ValueError("cannot summarise an empty list of measurements")
    ordered = sorted(values)
    mean = statistics.fmean(ordered)
    stdev = statistics.stdev(ordered) if len(ordered) > 1 else 0.0
    return Stats(
        n=len(ordered),
        mean=mean,
        stdev=stdev,
        cv=stdev / mean if mean else 0.0,
        min=ordered[0],
        p50=percentile(ordered, 50),
        p90=percentile(ordered, 90),
        p99=percentile(ordered, 99),
        max=ordered[-1],
    )


def capped_samples(values: list[float], cap: int = 2000) -> list[float]:
    """The sorted values, evenly subsampled to at most `cap` (keeps the store small; the
    distribution's shape survives, for CDF plots)."""
    ordered = sorted(values)
    if len(ordered) <= cap:
        return ordered
    step = (len(ordered) - 1) / (cap - 1)
    return [ordered[round(i * step)] for i in range(cap)]


@dataclass(frozen=True, kw_only=True, slots=True)
class LoopTiming:
    """Per-call durations of a timed loop and the wall time of the whole loop (seconds)."""

    durations: list[float]
    wall_seconds: float
    warmup_seconds: list[float]  # the excluded warm-up calls, first call first

    @property
    def iterations(self) -> int:
        return len(self.durations)


def timed_loop(
    call: Callable[[], object],
    *,
    warmup: int,
    min_iters: int,
    min_seconds: float,
    max_seconds: float = float("inf"),
    clock: Callable[[], float] = time.perf_counter,
    measure: Callable[[Callable[[], object]], float] | None = None,
) -> LoopTiming:
    """Run `call` `warmup` times untimed, then until BOTH min_iters and min_seconds are reached
    (or max_seconds passes, after at least one timed call).

    `measure(call) -> seconds` times one call; the default uses `clock` around it. A GPU caller
    passes a CUDA-event timer here so the per-call figure is device time.
    """
    timer = measure or (lambda fn: _clock_call(fn, clock))
    warm = [timer(call) for _ in range(warmup)]
    durations: list[float] = []
    start = clock()
    while True:
        durations.append(timer(call))
        elapsed = clock() - start
        if len(durations) >= min_iters and elapsed >= min_seconds:
            break
        if elapsed >= max_seconds:
            break
    return LoopTiming(durations=durations, wall_seconds=clock() - start, warmup_seconds=warm)


def _clock_call(fn: Callable[[], object], clock: Callable[[], float]) -> float:
    t0 = clock()
    fn()
    return clock() - t0
