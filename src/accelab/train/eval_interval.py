"""A plan's final eval score against the baseline seeds', with an interval: is it measurably
better, worse, or not distinguishable from the seeds? Pure: no torch, no I/O.

The companion of `convergence` (which judges the loss curve): this judges the score the curve
ends on, from the seeds' spread and, for an accuracy, the eval set's sampling error.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from accelab.measure.paired import t_quantile

CONFIDENCE = 0.95


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalDifference:
    """candidate - the baseline seeds' mean, with its interval."""

    difference: float
    low: float
    high: float
    candidate: float
    baseline_mean: float
    seeds: int
    verdict: Literal["better", "worse", "no measurable difference"]
    reason: str
    confidence: float = CONFIDENCE

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def eval_difference(
    candidate_score: float,
    baseline_scores: Sequence[float],
    *,
    eval_samples: int | None,
    higher_is_better: bool,
    confidence: float = CONFIDENCE,
) -> EvalDifference:
    """The candidate's eval score minus the baseline seeds' mean, with an interval that includes:

    - the seed-to-seed spread: Student's t over the baseline seeds (k - 1 degrees of freedom) on
      s x sqrt(1 + 1/k), since the candidate is one run with a seed's own spread (assumed equal to
      the baseline's) and the mean of k seeds has s / sqrt(k);
    - for an accuracy (pass `eval_samples`, the eval set's size; None for a loss or perplexity,
      whose per-sample spread is not recorded): the eval set's sampling error, binomial, for the
      candidate and the baseline mean as if independent (they share the eval set, so this
      over-covers), with p = (correct + 1) / (n + 2) so a 100% score still has some.

    The two half-widths add in quadrature. The verdict is "better" or "worse" only when the
    interval excludes 0.
    """
    k = len(baseline_scores)
    if k < 2:
        raise ValueError(f"an eval interval needs the baseline's seed spread: got {k} score(s); run 2 or more seeds")
    scores = [candidate_score, *baseline_scores]
    if eval_samples is not None and not all(0.0 <= s <= 1.0 for s in scores):
        raise ValueError(f"accuracies must be within 0..1, got {scores}; pass eval_samples=None for a loss")
    mean = statistics.fmean(baseline_scores)
    seed_half = t_quantile(0.5 + confidence / 2, k - 1) * statistics.stdev(baseline_scores) * math.sqrt(1 + 1 / k)
    sample_half = 0.0 if eval_samples is None else _sampling_half(candidate_score, mean, eval_samples, confidence)
    half = math.hypot(seed_half, sample_half)
    diff = candidate_score - mean
    low, high = diff - half, diff + half
    verdict: Literal["better", "worse", "no measurable difference"] = "no measurable difference"
    if low > 0 or high < 0:
        verdict = "better" if (low > 0) == higher_is_better else "worse"
    what = f"{k} seeds' spread" + (f" and {eval_samples:,} eval samples" if eval_samples is not None else "")
    return EvalDifference(
        difference=diff,
        low=low,
        high=high,
        candidate=candidate_score,
        baseline_mean=mean,
        seeds=k,
        verdict=verdict,
        reason=f"{diff:+#.3g} vs the baseline's {mean:#.3g} ({confidence:.0%} interval {low:+#.3g} to {high:+#.3g}, "
        f"from {what}): {verdict}",
        confidence=confidence,
    )


def _sampling_half(candidate: float, baseline_mean: float, eval_samples: int, confidence: float) -> float:
    """Half-width of the eval set's sampling error on the difference of two accuracies (normal)."""
    z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2)
    return z * math.sqrt(_binomial_variance(candidate, eval_samples) + _binomial_variance(baseline_mean, eval_samples))


def _binomial_variance(p: float, n: int) -> float:
    if n < 1:
        raise ValueError(f"eval_samples={n} must be at least 1 (the eval set's size)")
    shrunk = (p * n + 1) / (n + 2)
    return shrunk * (1 - shrunk) / n
