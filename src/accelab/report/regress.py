"""The regression gate: is a candidate run worse than its baseline? Pure: no I/O, no printing.

Like with like
--------------
Runs are paired by (model, plan name, workload shape); two single runs must share model and
workload, and runs from machines with different fingerprints are refused unless
`allow_different_machines=True` (`pairing` gives the whole rule).

The rule
--------
For each metric, `change` = candidate / baseline - 1. It counts against the candidate in the
bad direction only (latency and memory up, throughput down). A move in the bad direction is a
REGRESSION only when it exceeds BOTH
  * its threshold: `latency` (p50, p99, TTFT, TPOT) and `throughput` default to 5 %, peak
    memory to 10 %; and
  * the noise of the two runs: `noise_factor` (2) x sqrt(s_base^2 + s_cand^2), where s is the
    relative spread of each run:
      - p50 and throughput: the coefficient of variation (stdev / mean) of the per-call
        latencies;
      - p99: the tail width (p99 - p50) / p50, because one stall moves the p99 of a short run
        far more than the cv says.
    Per-call spread, not the standard error stdev/sqrt(n): calls in one run are not independent
    draws (one clock state, one set of neighbours on a shared machine), so repeated runs drift
    apart by much more than stdev/sqrt(n); the per-call spread is the honest yardstick.
The limit shown is max(threshold, noise). A move beyond the threshold but within the noise is
reported as "noise" and passes; a move beyond the limit in the good direction is "improved".
Peak memory has no spread in a Result, so it is judged on its threshold alone.

With the machine's noise (Results measured in rounds, `accelab.measure.noise`): a run whose
noise record is "unreliable" (too few quiet rounds) makes every timing check of its pair
"unreliable": it is reported, never called a regression (rerun it on a quieter machine). When
both runs kept their per-round rates, throughput is judged by the statistics compare and tune
use (`accelab.measure.paired`): Welch's interval on the two runs' quiet rounds, a REGRESSION
only when the whole interval is below 1.0 and the estimate is beyond the threshold. Training runs
(kind "train") are checked on step time p50, samples/s and epoch time, each against the cv of
the per-step times, and on peak memory.
Quality: a verdict worse than the baseline's (pass -> warn, pass -> fail, warn -> fail) is a
regression; a candidate that did not run (error, oom, timeout, crashed) where the baseline ran is
a regression.

In CI
-----
    accelab bench minilm-l6 -b 8 --tag main-$BASE_SHA      # on the target branch
    accelab bench minilm-l6 -b 8 --tag pr-$SHA             # on the change, same runner
    accelab regress --baseline main-$BASE_SHA --candidate pr-$SHA   # exit 1 on a regression
A tag that names a whole compare group (`accelab compare ... --tag T`) is compared pair by pair.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from accelab.measure.paired import unpaired_ratio
from accelab.report import metrics as M
from accelab.report.pairing import MACHINES_DIFFER, machine_check, pair_label, pair_runs, plan_differences
from accelab.report.regress_metrics import Better, Family, MetricSpec, metric_specs
from accelab.results import contract as K
from accelab.results.result import Result

Verdict = Literal["ok", "improved", "noise", "unreliable", "REGRESSION", "-"]
# "cannot tell" ranks with warn: from pass it is a regression (the check no longer shows a pass)
QUALITY_RANK = {"pass": 0, "warn": 1, "cannot tell": 1, "fail": 2}
MIN_CALLS = 5  # fewer timed calls than this: the spread itself is a guess


@dataclass(frozen=True, kw_only=True, slots=True)
class Thresholds:
    """Relative moves (0.05 = 5 %) tolerated in the bad direction, before noise is considered."""

    latency: float = 0.05
    throughput: float = 0.05
    memory: float = 0.10
    noise_factor: float = 2.0

    def __post_init__(self) -> None:
        for name in ("latency", "throughput", "memory", "noise_factor"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < 100):
                raise ValueError(f"threshold {name}={value!r} is out of range: give a fraction >= 0 (0.05 = 5%)")

    def for_family(self, family: Family) -> float:
        return {"latency": self.latency, "throughput": self.throughput, "memory": self.memory}[family]


@dataclass(frozen=True, kw_only=True, slots=True)
class Check:
    """One metric of one pair: the table row `metric | baseline | candidate | change | limit | verdict`."""

    metric: str
    unit: str
    baseline: float | str | None
    candidate: float | str | None
    change: float | None  # candidate / baseline - 1
    limit: float | None  # relative move tolerated in the bad direction: max(threshold, noise)
    verdict: Verdict
    why: str = ""  # how the limit was set, or why there is no verdict


@dataclass(frozen=True, kw_only=True, slots=True)
class PairResult:
    label: str  # "minilm-l6 · baseline · forward · batch 8"
    baseline_id: str
    candidate_id: str
    checks: tuple[Check, ...]
    warnings: tuple[str, ...] = ()

    @property
    def regressed(self) -> bool:
        return any(c.verdict == "REGRESSION" for c in self.checks)

    @property
    def compared(self) -> int:
        return sum(c.verdict != "-" for c in self.checks)


@dataclass(frozen=True, kw_only=True, slots=True)
class Comparison:
    pairs: tuple[PairResult, ...]
    warnings: tuple[str, ...] = ()
    only_baseline: tuple[str, ...] = ()  # labels of runs with no partner
    only_candidate: tuple[str, ...] = ()

    @property
    def regressed(self) -> bool:
        return any(p.regressed for p in self.pairs)

    @property
    def compared(self) -> int:
        return sum(p.compared for p in self.pairs)


# -- judging ----------------------------------------------------------------------------------
def judge(
    base: float,
    cand: float,
    *,
    better: Better,
    threshold: float,
    spreads: tuple[float | None, float | None] = (None, None),
    noise_factor: float = 2.0,
) -> tuple[float | None, float | None, Verdict, str]:
    """(change, limit, verdict, why) for one metric; see the module docstring for the rule."""
    if base <= 0:
        return None, None, "-", "baseline is 0: no relative change"
    change = cand / base - 1
    worse = change if better == "lower" else -change
    known = [s for s in spreads if s is not None]
    noise = noise_factor * math.sqrt(sum(s * s for s in known)) if known else None
    limit = max(threshold, noise or 0.0)
    why = f"threshold {threshold:.0%}" if noise is None or noise <= threshold else f"noise {noise:.1%}"
    if worse > limit:
        return change, limit, "REGRESSION", why
    if worse > threshold:
        return change, limit, "noise", f"beyond the {threshold:.0%} threshold, within the {noise:.1%} noise"
    if -worse > limit:
        return change, limit, "improved", why
    return change, limit, "ok", why


def unreliable_side(base: Result, cand: Result) -> str | None:
    """Why a pair's timings cannot be judged: a run measured under too much noise."""
    for run, side in ((base, "baseline"), (cand, "candidate")):
        noise = run.metrics.get(K.NOISE) or {}
        if noise.get("level") == "unreliable":
            return (
                f"the {side} ran under noise ({noise.get('reason')}; {noise.get('rounds_used')} of "
                f"{noise.get('rounds')} rounds quiet enough): rerun it on a quieter machine"
            )
    return None


def quiet_rates(result: Result) -> list[float]:
    """The per-round rates of the rounds a Result's figures come from."""
    return [
        float(r["rate"])
        for r in result.metrics.get(K.ROUNDS) or []
        if isinstance(r, dict) and r.get("used", True) and r.get("rate")
    ]


def judge_rounds(
    base: Result, cand: Result, threshold: float
) -> tuple[float | None, float | None, Verdict, str] | None:
    """Throughput by the two runs' quiet rounds (module docstring), or None without them."""
    b, c = quiet_rates(base), quiet_rates(cand)
    if len(b) < 2 or len(c) < 2:
        return None
    ratio = unpaired_ratio(c, b, threshold=threshold)
    if ratio.value is None or ratio.low is None:
        return None
    change = ratio.value - 1
    why = f"rounds: {ratio.reason}"
    if ratio.verdict == "slower":
        return change, threshold, "REGRESSION", why
    if ratio.verdict == "faster":
        return change, threshold, "improved", why
    return change, threshold, ("noise" if abs(change) > threshold else "ok"), why


def check_metric(spec: MetricSpec, base: Result, cand: Result, thresholds: Thresholds) -> Check | None:
    b, c = spec.read(base), spec.read(cand)
    if b is None:
        return None  # not measured by this kind: not a row
    if c is None:
        return Check(
            metric=spec.label,
            unit=spec.unit,
            baseline=b,
            candidate=None,
            change=None,
            limit=None,
            verdict="-",
            why="not measured in the candidate",
        )
    if spec.family != "memory" and (why_not := unreliable_side(base, cand)):
        return Check(
            metric=spec.label,
            unit=spec.unit,
            baseline=b,
            candidate=c,
            change=c / b - 1 if b else None,
            limit=None,
            verdict="unreliable",
            why=why_not,
        )
    if spec.label == "throughput" and (by_rounds := judge_rounds(base, cand, thresholds.throughput)) is not None:
        change, limit, verdict, why = by_rounds
        return Check(
            metric=spec.label,
            unit=spec.unit,
            baseline=b,
            candidate=c,
            change=change,
            limit=limit,
            verdict=verdict,
            why=why,
        )
    change, limit, verdict, why = judge(
        b,
        c,
        better=spec.better,
        threshold=thresholds.for_family(spec.family),
        spreads=(spec.spread(base), spec.spread(cand)),
        noise_factor=thresholds.noise_factor,
    )
    return Check(
        metric=spec.label, unit=spec.unit, baseline=b, candidate=c, change=change, limit=limit, verdict=verdict, why=why
    )


def check_quality(base: Result, cand: Result) -> Check | None:
    b, c = M.quality_verdict(base), M.quality_verdict(cand)
    if b is None:
        return None
    if c is None:
        return Check(
            metric="quality",
            unit="",
            baseline=b,
            candidate=None,
            change=None,
            limit=None,
            verdict="-",
            why="the candidate was not verified (run it with the quality guard)",
        )
    worse = QUALITY_RANK.get(c, 2) > QUALITY_RANK.get(b, 2)
    better = QUALITY_RANK.get(c, 2) < QUALITY_RANK.get(b, 2)
    verdict: Verdict = "REGRESSION" if worse else "improved" if better else "ok"
    return Check(
        metric="quality",
        unit="",
        baseline=b,
        candidate=c,
        change=None,
        limit=None,
        verdict=verdict,
        why=f"verdict {b} -> {c}" if b != c else "",
    )


def compare_pair(base: Result, cand: Result, thresholds: Thresholds) -> PairResult:
    label = pair_label(base)
    warnings = [f"plans differ: {d}" for d in plan_differences(base.plan, cand.plan)]
    if not base.ok:
        warnings.append(
            f"the baseline run {base.run_id} is {base.status}, nothing to compare against: {M.first_line(base.reason)}"
        )
        return PairResult(
            label=label, baseline_id=base.run_id, candidate_id=cand.run_id, checks=(), warnings=tuple(warnings)
        )
    if not cand.ok:
        status = Check(
            metric="status",
            unit="",
            baseline=base.status,
            candidate=cand.status,
            change=None,
            limit=None,
            verdict="REGRESSION",
            why=M.first_line(cand.reason),
        )
        return PairResult(
            label=label, baseline_id=base.run_id, candidate_id=cand.run_id, checks=(status,), warnings=tuple(warnings)
        )
    checks = [check_metric(spec, base, cand, thresholds) for spec in metric_specs(base)]
    checks.append(check_quality(base, cand))
    for run, side in ((base, "baseline"), (cand, "candidate")):
        n = M.stat(run, "n")
        if n is not None and n < MIN_CALLS:
            warnings.append(f"the {side} timed only {int(n)} calls: its noise estimate is rough; raise --min-iters")
    return PairResult(
        label=label,
        baseline_id=base.run_id,
        candidate_id=cand.run_id,
        checks=tuple(c for c in checks if c is not None),
        warnings=tuple(warnings),
    )


def compare(
    baseline: list[Result],
    candidate: list[Result],
    thresholds: Thresholds = Thresholds(),
    *,
    allow_different_machines: bool = False,
) -> Comparison:
    """Pair the runs like with like and check each pair; raises ValueError on a refused comparison."""
    pairs, only_b, only_c = pair_runs(baseline, candidate)
    warnings: list[str] = []
    for base, cand in pairs:
        message = machine_check(base, cand)
        if message and message.startswith(MACHINES_DIFFER):
            if not allow_different_machines:
                raise ValueError(
                    f"{message}. Rerun both on one machine, or pass --allow-different-machines to compare them anyway"
                )
            message = f"WARNING: {message}; compared anyway (--allow-different-machines)"
        if message and message not in warnings:
            warnings.append(message)
    warnings += [f"only in the baseline, not compared: {pair_label(r)} ({r.run_id})" for r in only_b]
    warnings += [f"only in the candidate, not compared: {pair_label(r)} ({r.run_id})" for r in only_c]
    return Comparison(
        pairs=tuple(compare_pair(b, c, thresholds) for b, c in pairs),
        warnings=tuple(warnings),
        only_baseline=tuple(pair_label(r) for r in only_b),
        only_candidate=tuple(pair_label(r) for r in only_c),
    )
