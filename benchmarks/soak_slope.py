"""The slope of a soak's memory samples, in MB per hour, with a 95% interval. Pure (numpy, scipy).

Ordinary least squares gives the slope; its interval uses Newey-West's standard error (Bartlett
weights, floor(n^(1/3)) lags), because consecutive memory samples are not independent draws: a
plain OLS interval would be too narrow wherever memory wanders slowly. The interval is the slope
plus or minus Student's t at n - 2 degrees of freedom times that error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.stats import t as student_t


@dataclass(frozen=True)
class Slope:
    slope: float  # MB per hour
    low: float
    high: float
    lags: int


def slope_mb_per_hour(minutes: list[float], mb: list[float], confidence: float = 0.95) -> Slope:
    x = np.asarray(minutes, dtype=np.float64) / 60.0  # hours
    y = np.asarray(mb, dtype=np.float64)
    n = len(x)
    if n < 3:
        raise ValueError(f"a slope with an interval needs at least 3 samples, got {n}")
    xc = x - x.mean()
    sxx = float(xc @ xc)
    if sxx == 0:
        raise ValueError("the samples are all at the same minute: no slope")
    slope = float(xc @ (y - y.mean())) / sxx
    residuals = y - y.mean() - slope * xc
    scores = xc * residuals  # the slope's estimating function, one term a sample
    lags = int(math.floor(n ** (1 / 3)))
    variance = float(scores @ scores)
    for lag in range(1, lags + 1):
        weight = 1 - lag / (lags + 1)
        variance += 2 * weight * float(scores[lag:] @ scores[:-lag])
    error = math.sqrt(max(variance, 0.0) * n / (n - 2)) / sxx
    half = float(student_t.ppf(0.5 + confidence / 2, n - 2)) * error
    return Slope(slope=slope, low=slope - half, high=slope + half, lags=lags)
