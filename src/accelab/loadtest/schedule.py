"""Arrival times of an open-loop load test. Pure, seeded: the same call gives the same times.

Inter-arrival gaps follow a gamma distribution with shape `burstiness` and mean 1/rate:
burstiness 1 is a Poisson process (exponential gaps); below 1 requests come in bursts,
above 1 they are more evenly spaced (the convention of vLLM's benchmark_serving).
"""

from __future__ import annotations

import random


def arrival_times(
    rate: float, *, n: int | None = None, duration_s: float | None = None, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Seconds from the start at which to send each request: at most `n` of them, all before
    `duration_s` (at least one bound must be given)."""
    if rate <= 0:
        raise ValueError(f"rate={rate} must be more than 0 requests/s")
    if burstiness <= 0:
        raise ValueError(f"burstiness={burstiness} must be more than 0 (1 = Poisson)")
    if n is None and duration_s is None:
        raise ValueError("bound the schedule with n (--requests) or duration_s (--duration)")
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)  # mean gap = shape * scale = 1 / rate
    times: list[float] = []
    t = 0.0
    while n is None or len(times) < n:
        t += rng.gammavariate(burstiness, scale)
        if duration_s is not None and t >= duration_s:
            break
        times.append(t)
    return times
