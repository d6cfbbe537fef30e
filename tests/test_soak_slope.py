"""The soak's memory verdict (benchmarks/soak_slope.py): a slope in MB per hour with a 95% interval
that stays honest when consecutive samples are correlated."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from soak_slope import slope_mb_per_hour  # benchmarks/ is not a package: it is put on sys.path first


def test_a_steady_growth_is_found_with_its_rate():
    minutes = np.arange(10, 121, 1.0)
    rng = np.random.default_rng(0)
    mb = 2300 + 6.0 * minutes / 60 + rng.normal(0, 0.5, len(minutes))
    fit = slope_mb_per_hour(list(minutes), list(mb))
    assert fit.low < 6.0 < fit.high and fit.low > 5.0  # 6 MB/h, told apart from the 5 MB/h line
    assert fit.lags == 4  # floor(111 ** (1/3))


def test_flat_memory_has_an_interval_around_zero_under_the_line():
    minutes = np.arange(10, 121, 1.0)
    mb = 2300 + np.random.default_rng(1).normal(0, 1.0, len(minutes))
    fit = slope_mb_per_hour(list(minutes), list(mb))
    assert fit.low < 0 < fit.high and fit.high < 5.0


def test_correlated_wander_widens_the_interval_beyond_the_independent_one():
    """A random walk (memory that drifts and stays) has no trend, but an interval that assumed
    independent samples would often claim one; Newey-West's is wider."""
    minutes = np.arange(0, 120, 1.0)
    walk = 2300 + np.cumsum(np.random.default_rng(2).normal(0, 0.3, len(minutes)))
    fit = slope_mb_per_hour(list(minutes), list(walk))
    x = minutes / 60
    xc = x - x.mean()
    residuals = walk - walk.mean() - fit.slope * xc
    independent_error = np.sqrt(residuals @ residuals / (len(x) - 2) / (xc @ xc))
    assert (fit.high - fit.low) / 2 > 1.5 * 1.98 * independent_error


def test_too_few_samples_is_an_error_that_says_so():
    with pytest.raises(ValueError, match="at least 3 samples"):
        slope_mb_per_hour([10.0, 11.0], [1.0, 2.0])
