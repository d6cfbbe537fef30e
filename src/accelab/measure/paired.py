"""How much faster one plan is than another, with a confidence interval, and when to say "no
measurable difference". Pure: no torch, no I/O.

Paired rounds (compare, tune's final, the probes, train --bench): the plans ran in alternating
short rounds, so a busy minute hits both sides of a round alike. Each round gives one ratio
candidate_rate / reference_rate; the speed-up is their geometric mean, and its interval is
Student's t on the logs of the ratios (ratios multiply, and their logs are close to normal).
Rounds whose noise window was unreliable (`accelab.measure.noise`) are left out.

Unpaired (regress: two runs made at different times): Welch's t on the logs of each run's
per-round rates, the same verdict rule.

The verdict, as criterion.rs judges a change:
- fewer than `min_pairs` usable rounds: "unreliable" (the machine did not let us measure);
- the interval includes 1.0: "no measurable difference";
- the estimate within the noise threshold (default 2%) of 1.0: "no measurable difference";
- otherwise "faster" or "slower".
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

Verdict = Literal["faster", "slower", "no measurable difference", "unreliable"]
CONFIDENCE = 0.95
NOISE_THRESHOLD = 0.02
MIN_PAIRS = 3
NO_DIFFERENCE: Verdict = "no measurable difference"


@dataclass(frozen=True, kw_only=True, slots=True)
class Ratio:
    """candidate / reference of a higher-is-better rate: 1.4 = the candidate is 1.4x as fast."""

    value: float | None
    low: float | None  # the confidence interval
    high: float | None
    rounds: int  # the rounds it comes from
    dropped: int  # rounds left out as unreliable
    verdict: Verdict
    reason: str
    confidence: float = CONFIDENCE

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def decided(self) -> bool:
        return self.verdict in ("faster", "slower")


def t_quantile(p: float, df: float) -> float:
    """The p quantile of Student's t with df degrees of freedom."""
    from scipy.stats import t as student_t  # 1.4 s of import every server paid at start-up for this module

    return float(student_t.ppf(p, df))


def judge(value: float, low: float, high: float, *, threshold: float = NOISE_THRESHOLD) -> Verdict:
    if low <= 1.0 <= high:
        return NO_DIFFERENCE
    if abs(math.log(value)) < math.log1p(threshold):
        return NO_DIFFERENCE
    return "faster" if value > 1.0 else "slower"


def _describe(
    verdict: Verdict, value: float, low: float, high: float, rounds: int, confidence: float, threshold: float
) -> str:
    ci = f"{confidence * 100:.0f}% CI {low:.2f}-{high:.2f}, {rounds} rounds"
    if verdict == NO_DIFFERENCE:
        if low <= 1.0 <= high:
            return f"no measurable difference: {value:.2f}x, {ci} includes 1.00"
        return f"no measurable difference: {value:.2f}x is within the {threshold * 100:.0f}% noise threshold ({ci})"
    return f"{value:.2f}x ({verdict}; {ci})"


def _unreliable(rounds: int, dropped: int, min_pairs: int, why: str, confidence: float) -> Ratio:
    usable = rounds - dropped
    text = f"unreliable: {usable} of {rounds} rounds were quiet enough to compare (at least {min_pairs} needed)"
    return Ratio(
        value=None,
        low=None,
        high=None,
        rounds=usable,
        dropped=dropped,
        verdict="unreliable",
        reason=text + (f"; {why}" if why else ""),
        confidence=confidence,
    )


def paired_ratio(
    candidate: Sequence[float],
    reference: Sequence[float],
    usable: Sequence[bool] | None = None,
    *,
    confidence: float = CONFIDENCE,
    threshold: float = NOISE_THRESHOLD,
    min_pairs: int = MIN_PAIRS,
    why_dropped: str = "",
) -> Ratio:
    """Round r of `candidate` and `reference` (higher-is-better rates) ran back to back; rounds
    with `usable[r]` False (an unreliable noise window on either side) are left out."""
    if len(candidate) != len(reference):
        raise ValueError(f"paired rounds differ in number: {len(candidate)} candidate, {len(reference)} reference")
    keep = list(usable) if usable is not None else [True] * len(candidate)
    logs = [math.log(c / r) for c, r, k in zip(candidate, reference, keep) if k and c > 0 and r > 0]
    dropped = len(candidate) - len(logs)
    if len(logs) < min_pairs:
        return _unreliable(len(candidate), dropped, min_pairs, why_dropped, confidence)
    mean = statistics.fmean(logs)
    half = t_quantile(0.5 + confidence / 2, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return _ratio(mean, half, len(logs), dropped, confidence, threshold)


def unpaired_ratio(
    candidate: Sequence[float],
    reference: Sequence[float],
    *,
    confidence: float = CONFIDENCE,
    threshold: float = NOISE_THRESHOLD,
    min_rounds: int = 2,
) -> Ratio:
    """Two independent runs' per-round rates (usable rounds only): Welch's interval on the
    difference of their mean logs."""
    a = [math.log(x) for x in candidate if x > 0]
    b = [math.log(x) for x in reference if x > 0]
    if len(a) < min_rounds or len(b) < min_rounds:
        return Ratio(
            value=None,
            low=None,
            high=None,
            rounds=min(len(a), len(b)),
            dropped=0,
            verdict="unreliable",
            reason=f"unreliable: {len(a)} and {len(b)} quiet rounds (at least {min_rounds} each needed)",
            confidence=confidence,
        )
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    mean = statistics.fmean(a) - statistics.fmean(b)
    if va + vb == 0:
        return _ratio(mean, 0.0, min(len(a), len(b)), 0, confidence, threshold)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = t_quantile(0.5 + confidence / 2, df) * math.sqrt(va + vb)
    return _ratio(mean, half, min(len(a), len(b)), 0, confidence, threshold)


def _ratio(mean: float, half: float, rounds: int, dropped: int, confidence: float, threshold: float) -> Ratio:
    value, low, high = math.exp(mean), math.exp(mean - half), math.exp(mean + half)
    verdict = judge(value, low, high, threshold=threshold)
    return Ratio(
        value=value,
        low=low,
        high=high,
        rounds=rounds,
        dropped=dropped,
        verdict=verdict,
        reason=_describe(verdict, value, low, high, rounds, confidence, threshold),
        confidence=confidence,
    )


def relative_half_width(ratio: Ratio) -> float | None:
    """How wide the interval is, relative to the estimate (0.05 = +-5%); None when unreliable."""
    if ratio.value is None or ratio.low is None or ratio.high is None:
        return None
    return (ratio.high - ratio.low) / 2 / ratio.value


def check_overlap(ratio: Ratio, candidate: Sequence[float], reference: Sequence[float]) -> Ratio:
    """A decided ratio stands only if every quiet round of the candidate is on the same side of
    the reference's median rate. A plan that runs in regimes (measured here: torchao's eager
    int8 weight-only decoding switching between ~16 and ~30 tokens/s within one process on a
    quiet machine) can put all of its paired rounds in one regime; its unpaired rounds then
    show the other, and the paired interval alone would be a confident wrong answer.
    `candidate` / `reference`: every quiet round's rate, paired or not."""
    if not ratio.decided or not candidate or not reference or ratio.value is None:
        return ratio
    middle = statistics.median(reference)
    low, high = min(candidate) / middle, max(candidate) / middle
    straddles = low < 1.0 < high
    if not straddles:
        return ratio
    reason = (
        f"no measurable difference: its own quiet rounds ran from {low:.2f}x to {high:.2f}x the reference's "
        f"median, on both sides of it (the plan runs in regimes); the paired rounds alone said {ratio.reason}"
    )
    return Ratio(
        value=ratio.value,
        low=ratio.low,
        high=ratio.high,
        rounds=ratio.rounds,
        dropped=ratio.dropped,
        verdict=NO_DIFFERENCE,
        reason=reason,
        confidence=ratio.confidence,
    )
