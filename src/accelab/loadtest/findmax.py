"""The highest request rate that still meets the SLO, found with an injected `measure(rate)`:
bracket by doubling (or halving when the start rate already fails), then bisect, within a
bounded number of measurements. Pure: the measuring is someone else's job."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, kw_only=True, slots=True)
class Probe:
    rate: float
    passed: bool
    summary: Any


@dataclass(kw_only=True, slots=True)
class FindMax:
    best_rate: float | None  # highest rate measured that passed; None when none did
    lowest_failing: float | None  # lowest rate measured that failed; None: never saturated
    probes: list[Probe] = field(default_factory=list)

    @property
    def saturated(self) -> bool:
        return self.lowest_failing is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            "best_rate": self.best_rate,
            "lowest_failing": self.lowest_failing,
            "probes": [{"rate": p.rate, "passed": p.passed} for p in self.probes],
        }


def goodput_at_least(target: float) -> Callable[[Any], bool]:
    """The usual pass rule: the fraction of requests that met every SLO is >= target."""
    if not 0 < target <= 1:
        raise ValueError(f"goodput target {target} must be in (0, 1], e.g. 0.95")

    def passes(summary: Any) -> bool:
        value = summary["goodput_fraction"] if isinstance(summary, dict) else summary.goodput_fraction
        return value >= target

    return passes


def find_max(
    measure: Callable[[float], Any],
    passes: Callable[[Any], bool],
    *,
    start_rate: float,
    max_steps: int = 10,
    rel_tol: float = 0.05,
    min_rate: float = 0.01,
) -> FindMax:
    """Probe rates until the pass/fail boundary is known within `rel_tol` (relative to the
    passing rate) or `max_steps` measurements were made."""
    if start_rate <= 0:
        raise ValueError(f"start rate {start_rate} must be more than 0")
    if max_steps < 1:
        raise ValueError(f"max_steps={max_steps} must be 1 or more")
    result = FindMax(best_rate=None, lowest_failing=None)

    def probe(rate: float) -> bool:
        summary = measure(rate)
        passed = bool(passes(summary))
        result.probes.append(Probe(rate=rate, passed=passed, summary=summary))
        if passed and (result.best_rate is None or rate > result.best_rate):
            result.best_rate = rate
        if not passed and (result.lowest_failing is None or rate < result.lowest_failing):
            result.lowest_failing = rate
        return passed

    # 1. bracket: double while passing, or halve while failing
    rate = start_rate
    if probe(rate):
        while len(result.probes) < max_steps and probe(rate * 2):
            rate *= 2
    else:
        while len(result.probes) < max_steps and rate / 2 >= min_rate and not probe(rate / 2):
            rate /= 2
    # 2. bisect between the best pass and the lowest failure
    while len(result.probes) < max_steps and result.best_rate and result.lowest_failing:
        lo, hi = result.best_rate, result.lowest_failing
        if (hi - lo) / lo <= rel_tol:
            break
        probe((lo + hi) / 2)
    return result
