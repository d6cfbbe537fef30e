"""95% intervals for the quality figures, and the sample size that would decide. Pure: numpy
and scipy, no torch, no I/O.

Two methods, each where its assumptions hold:
- **Bootstrap over independent units** (generation: windows of the evaluation text; encoders:
  sentences; classifiers: images for top-5 overlap and the accuracy change). Positions inside a
  window share their context, so they are not independent draws: resampling positions would give
  intervals several times too narrow. Windows are non-overlapping stretches of different
  documents, close to independent, so they are resampled whole, and a figure pooled over
  positions (the 99th percentile of the KL divergence) is recomputed on each resample's
  positions. Percentile bootstrap, `RESAMPLES` resamples from a fixed seed (the same inputs give
  the same interval on every run), widened for small samples by Hesterberg's expanded percentile
  (the tail probability alpha/2 becomes Phi(-sqrt(n/(n-1)) t_{1-alpha/2, n-1})): the plain
  percentile interval is too narrow by about sqrt((n-1)/n) and z/t, which at 16-32 units is
  most of its under-coverage. (T. Hesterberg, "What teachers should know about the bootstrap",
  The American Statistician 69(4), 2015.)
- **Wilson score interval** for a share of independent yes/no outcomes (a classifier's top-1
  agreement over images): exact enough at any n, and never outside [0, 1], also when every
  image agrees (where a bootstrap would give the empty interval [1, 1]).

`samples_to_tell`: the interval's half-width shrinks as 1/sqrt(n), so an interval that
straddles a line at distance d from its estimate, with half-width h on that side, clears it at
about n (h/d)^2 units if the estimate holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy.stats import norm, t as student_t

CONFIDENCE = 0.95
RESAMPLES = 1000
SEED = 0
_CHUNK = 100  # resamples per call of the statistic: bounds the memory of pooled statistics


@dataclass(frozen=True, kw_only=True, slots=True)
class Interval:
    value: float
    low: float
    high: float

    def as_list(self) -> list[float | None]:
        """[low, high] for JSON (an unbounded side is None)."""
        return [None if math.isinf(self.low) else self.low, None if math.isinf(self.high) else self.high]


UNBOUNDED = (-math.inf, math.inf)


def expanded_tail(n: int, confidence: float = CONFIDENCE) -> float:
    """The tail probability the expanded percentile bootstrap reads at each end (< (1-conf)/2)."""
    alpha = 1 - confidence
    return float(norm.cdf(-math.sqrt(n / (n - 1)) * student_t.ppf(1 - alpha / 2, n - 1)))


def bootstrap(
    n: int,
    statistic: Callable[[np.ndarray], np.ndarray],
    *,
    resamples: int = RESAMPLES,
    seed: int = SEED,
    confidence: float = CONFIDENCE,
) -> tuple[float, float]:
    """The interval of a statistic of n independent units. `statistic(idx)` gets resampled unit
    indices [R, n] and returns the statistic of each resample [R]. Fewer than 2 units: unbounded."""
    if n < 2:
        return UNBOUNDED
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(resamples, n))
    values = np.concatenate([np.asarray(statistic(idx[i : i + _CHUNK]), float) for i in range(0, resamples, _CHUNK)])
    tail = expanded_tail(n, confidence)
    low, high = np.quantile(values, [tail, 1 - tail])
    return float(low), float(high)


def mean_interval(values: np.ndarray, **kw: float) -> Interval:
    """The mean of per-unit values [n] with its bootstrap interval."""
    values = np.asarray(values, dtype=np.float64)
    low, high = bootstrap(len(values), lambda idx: values[idx].mean(axis=1), **kw)  # type: ignore[arg-type]
    return Interval(value=float(values.mean()), low=low, high=high)


def wilson(successes: int, n: int, confidence: float = CONFIDENCE) -> Interval:
    """A share successes / n with its Wilson score interval."""
    if n == 0:
        return Interval(value=math.nan, low=0.0, high=1.0)
    z = float(norm.ppf(0.5 + confidence / 2))
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return Interval(value=p, low=max(0.0, centre - half), high=min(1.0, centre + half))


def samples_to_tell(interval: Interval, line: float, n: int) -> int | None:
    """About how many units would put the interval clear of `line`, if the estimate holds;
    None when the estimate sits on the line (no sample size tells)."""
    distance = abs(interval.value - line)
    half = interval.high - interval.value if line > interval.value else interval.value - interval.low
    if distance <= 0 or math.isinf(half):
        return None
    return max(n + 1, math.ceil(n * (half / distance) ** 2 - 1e-9))  # - 1e-9: 4.0000001 windows is 4


def wilson_samples_to_tell(share: float, line: float, n: int, confidence: float = CONFIDENCE) -> int | None:
    """About how many outcomes would put a Wilson interval at the same share clear of `line`
    (the 1/sqrt(n) rule is far off near a share of 0 or 1); None when the share is the line."""
    if share == line:
        return None

    def clears(m: int) -> bool:
        iv = wilson(round(share * m), m, confidence)
        return not iv.low < line < iv.high

    high = max(n + 1, 2)
    while not clears(high):
        if high > 10**7:
            return None
        high *= 2
    low = max(n, high // 2)
    while high - low > 1:  # the smallest size that clears, between low (does not) and high (does)
        middle = (low + high) // 2
        low, high = (low, middle) if clears(middle) else (middle, high)
    return high
