"""The tuner's search. Pure: no torch, no processes; `measure` is injected.

Phases, cheapest first:
1. screen: every variant once at the screening batch size, a short run. A variant that breaks
   a limit there is retried at smaller batches (halving) before it is dropped.
2. grow (throughput goal): the best `keep` variants grow their batch geometrically while
   throughput improves by at least `min_gain` and the limits hold; when a limit stops the
   growth, the gap between the last good and the first bad batch is bisected. A bigger batch
   that was faster by less than `min_gain` stays a contender for the final.
3. final: the two best candidates measured again with full-length runs: the winner against the
   runner-up. With `measure_together` (accelab's tune) the two run side by side in alternating
   rounds, and the paired ratio of their rounds decides, by the same statistics as compare and
   regress (`accelab.measure.paired`): an interval that includes 1.0, a lead within the noise
   threshold, or too few quiet rounds is a tie, and the faster of the two is written. Without
   it (one full-length run each, back to back), a lead beyond the runs' own spread (at least
   `noise_floor`) decides. The short screening runs only chose who reaches the final; when
   they ranked the two the other way, the final is the better evidence, so it decides.
Every measurement is kept with the reason it lost, for the table and the store.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, get_args

from accelab.measure.paired import Ratio, check_overlap, paired_ratio
from accelab.quality.verdict import tune_exclusion

Phase = Literal["screen", "grow", "final"]
# Later phases measure longer: a candidate's figure is its latest-phase run. "confirm" is
# a phase of stores written by earlier accelab versions (a second pair of final runs).
PHASE_RANK: dict[str, int] = {"screen": 0, "grow": 0, "final": 1, "confirm": 2}
Goal = Literal["throughput", "latency-p50", "latency-p99"]
QualityLevel = Literal["strict", "balanced", "loose", "off"]
QUALITY_LEVELS: tuple[QualityLevel, ...] = get_args(QualityLevel)


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    variant: str  # a plan (preset) name
    batch_size: int

    @property
    def key(self) -> str:
        return f"{self.variant}@{self.batch_size}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurement:
    candidate: Candidate
    phase: Phase
    status: str  # ok | unsupported | oom | error | timeout | crashed
    throughput: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    memory_mb: float | None = None
    quality: str | None = None  # verdict label: pass | warn | fail | cannot tell (...) | None (not checked)
    cv: float = 0.0  # coefficient of variation of the per-call latency
    seconds: float = 0.0  # what the measurement cost, wall time
    reason: str | None = None
    run_id: str | None = None
    rates: tuple[float, ...] = ()  # measured side by side: the rate of each round (items or tokens / s)
    usable: tuple[bool, ...] = ()  # ... and whether that round's noise window was quiet enough


@dataclass(frozen=True, kw_only=True, slots=True)
class Constraints:
    max_memory_mb: float | None = None
    p99_ms: float | None = None
    quality: QualityLevel = "balanced"

    def violation(self, m: Measurement) -> str | None:
        """Why a measurement is not acceptable, or None."""
        if m.status == "unsupported":
            return f"unsupported here: {m.reason}"
        if m.status == "oom":
            return "out of memory"
        if m.status != "ok":
            return f"{m.status}: {m.reason}"
        if self.max_memory_mb is not None and m.memory_mb is not None and m.memory_mb > self.max_memory_mb:
            return f"memory {m.memory_mb:.0f} MB > limit {self.max_memory_mb:.0f} MB"
        if self.p99_ms is not None and m.p99_ms is not None and m.p99_ms > self.p99_ms:
            return f"p99 {m.p99_ms:.1f} ms > SLA {self.p99_ms:.1f} ms"
        return tune_exclusion(m.quality, self.quality)

    def limit_kind(self, m: Measurement) -> str | None:
        """Which limit a violation hit: memory, sla, quality, unsupported, error."""
        why = self.violation(m)
        if why is None:
            return None
        if why.startswith(("memory", "out of memory")):
            return "memory"
        if why.startswith("p99"):
            return "sla"
        if why.startswith("quality"):
            return "quality"
        if why.startswith("unsupported"):
            return "unsupported"
        return "error"


def score(m: Measurement, goal: Goal) -> float:
    """Higher is better."""
    if goal == "throughput":
        return m.throughput or 0.0
    latency = m.p50_ms if goal == "latency-p50" else m.p99_ms
    return -(latency if latency is not None else float("inf"))


@dataclass(kw_only=True)
class SearchLog:
    measurements: list[Measurement] = field(default_factory=list)
    winner: Measurement | None = None
    runner_up: Measurement | None = None
    tie: bool = False  # the final's lead was within the noise
    final_ratio: str | None = None  # the final's paired ratio, in words (measured side by side)
    verdicts: dict[str, str] = field(default_factory=dict)  # candidate key -> why it lost / "winner"
    no_feasible_reason: str | None = None
    budget_spent: bool = False

    @property
    def measured_seconds(self) -> float:
        return sum(m.seconds for m in self.measurements)


Measure = Callable[[Candidate, Phase], Measurement]
# several candidates measured side by side in alternating rounds, one Measurement each, in order
MeasureTogether = Callable[[list[Candidate], Phase], list[Measurement]]


class _BudgetSpent(Exception):
    pass


@dataclass(kw_only=True)
class Search:
    variants: list[str]
    batch_sizes: list[int]  # allowed batch sizes, ascending (the geometric ladder)
    measure: Measure
    constraints: Constraints
    measure_together: MeasureTogether | None = None
    goal: Goal = "throughput"
    screen_batch: int = 1
    keep: int = 2
    min_gain: float = 0.03  # grow the batch only while throughput improves by this much
    noise_floor: float = 0.03  # differences under this (or under the runs' noise) are ties
    budget_s: float | None = None  # wall time for the whole search; then the best so far wins
    clock: Callable[[], float] = time.monotonic
    log: SearchLog = field(default_factory=SearchLog)
    _contenders: list[Measurement] = field(default_factory=list, init=False)  # bigger batches faster within noise
    _best_ok: dict[str, Measurement] = field(default_factory=dict)
    _start: float = 0.0

    # -- bookkeeping ----------------------------------------------------------------------
    def _run(self, candidate: Candidate, phase: Phase) -> Measurement:
        if self.budget_s is not None and self.clock() - self._start > self.budget_s:
            raise _BudgetSpent
        m = self.measure(candidate, phase)
        self._record(m, phase)
        return m

    def _record(self, m: Measurement, phase: Phase) -> None:
        candidate = m.candidate
        self.log.measurements.append(m)
        why = self.constraints.violation(m)
        if why is None:
            best = self._best_ok.get(candidate.key)
            if phase == "final" or best is None:
                self._best_ok[candidate.key] = m
        else:
            self.log.verdicts[candidate.key] = why

    def _ok(self, m: Measurement) -> bool:
        return self.constraints.violation(m) is None

    # -- phases ---------------------------------------------------------------------------
    def screen(self) -> list[Measurement]:
        survivors = []
        for variant in self.variants:
            batch = self.screen_batch
            while True:
                m = self._run(Candidate(variant=variant, batch_size=batch), "screen")
                kind = self.constraints.limit_kind(m)
                if kind is None:
                    survivors.append(m)
                    break
                # a limit that a smaller batch may meet: halve and retry
                if kind in ("memory", "sla") and batch > self.batch_sizes[0] and self.goal == "throughput":
                    batch = max(b for b in self.batch_sizes if b < batch)
                    continue
                break
        return sorted(survivors, key=lambda m: score(m, self.goal), reverse=True)

    def grow(self, start: Measurement) -> Measurement:
        """Geometric growth from a feasible measurement, then bisection at the limit."""
        best = start
        ladder = [b for b in self.batch_sizes if b > start.candidate.batch_size]
        bad: int | None = None
        for batch in ladder:
            m = self._run(Candidate(variant=start.candidate.variant, batch_size=batch), "grow")
            if not self._ok(m):
                bad = batch if self.constraints.limit_kind(m) in ("memory", "sla", "error") else None
                break
            if score(m, self.goal) < score(best, self.goal) * (1 + self.min_gain):
                if score(m, self.goal) > score(best, self.goal):
                    # faster, but by less than the noise: neither batch is known to be better, so
                    # the bigger one stays a contender and the full-length runs decide
                    self._contenders.append(m)
                else:
                    self._lost(m, f"no gain over batch {best.candidate.batch_size} ({_fmt(m)} vs {_fmt(best)})")
                break  # flat: bigger batches stop paying
            self._lost(best, f"batch {batch} was faster ({_fmt(m)} vs {_fmt(best)})")
            best = m
        if bad is not None:
            best = self._bisect(best, bad)
        return best

    def _lost(self, m: Measurement, why: str) -> None:
        self.log.verdicts.setdefault(m.candidate.key, why)

    def _bisect(self, good: Measurement, bad_batch: int) -> Measurement:
        lo, hi = good.candidate.batch_size, bad_batch
        best = good
        while hi - lo > max(1, lo // 4):  # stop within a quarter of the batch: finer steps are noise
            mid = (lo + hi) // 2
            m = self._run(Candidate(variant=good.candidate.variant, batch_size=mid), "grow")
            if self._ok(m):
                lo = mid
                if score(m, self.goal) > score(best, self.goal):
                    self._lost(best, f"batch {mid} was faster ({_fmt(m)} vs {_fmt(best)})")
                    best = m
                else:
                    self._lost(m, f"no gain over batch {best.candidate.batch_size} ({_fmt(m)} vs {_fmt(best)})")
            else:
                hi = mid
        return best

    def final(self, finalists: list[Measurement]) -> list[Measurement]:
        if self.measure_together is not None and len(finalists) > 1:
            if self.budget_s is not None and self.clock() - self._start > self.budget_s:
                raise _BudgetSpent
            again = self.measure_together([m.candidate for m in finalists], "final")
            for m in again:
                self._record(m, "final")
        else:
            again = [self._run(m.candidate, "final") for m in finalists]
        results = [m for m in again if self._ok(m)]
        return sorted(results, key=lambda m: score(m, self.goal), reverse=True)

    # -- the whole search -------------------------------------------------------------------
    def run(self) -> SearchLog:
        self._start = self.clock()
        try:
            return self._run_phases()
        except _BudgetSpent:
            self.log.budget_spent = True
            ranked = sorted(self._best_ok.values(), key=lambda m: score(m, self.goal), reverse=True)
            if not ranked:
                self.log.no_feasible_reason = "the --budget ran out before any plan met every limit; raise --budget"
                return self.log
            self.log.winner = ranked[0]
            self.log.runner_up = ranked[1] if len(ranked) > 1 else None
            self._explain_losers()
            return self.log

    def _run_phases(self) -> SearchLog:
        screened = self.screen()
        if not screened:
            self.log.no_feasible_reason = self._nothing_met()
            return self.log
        leaders = screened[: self.keep]
        for m in screened[self.keep + 1 :]:
            self._lost(m, f"slower in screening ({_fmt(m)} vs {_fmt(screened[0])} for {screened[0].candidate.key})")
        if self.goal == "throughput":
            leaders = [self.grow(m) for m in leaders] + self._contenders
        finalists = _distinct(
            sorted(leaders + screened[self.keep : self.keep + 1], key=lambda m: score(m, self.goal), reverse=True)
        )[:2]
        for m in leaders + screened[self.keep : self.keep + 1]:
            if m.candidate.key not in {f.candidate.key for f in finalists}:
                self._lost(m, f"slower than the finalists ({_fmt(m)})")
        finals = self.final(finalists)
        if not finals:
            self.log.no_feasible_reason = self._nothing_met()
            return self.log
        winner, runner_up, tie = finals[0], (finals[1] if len(finals) > 1 else None), False
        if runner_up is not None:
            decided = decide_final(winner, runner_up, goal=self.goal, noise_floor=self.noise_floor)
            winner, runner_up, tie = decided.winner, decided.runner_up, decided.tie
            self.log.final_ratio = decided.ratio  # None unless measured side by side
        self.log.winner, self.log.runner_up, self.log.tie = winner, runner_up, tie
        self._explain_losers()
        return self.log

    def _explain_losers(self) -> None:
        winner = self.log.winner
        assert winner is not None
        self.log.verdicts[winner.candidate.key] = "winner"
        if self.log.runner_up is not None:
            ru = self.log.runner_up.candidate.key
            why = f" ({self.log.final_ratio.split(': ', 1)[1]})" if self.log.final_ratio else " (within noise)"
            self.log.verdicts[ru] = ("tie with the winner" if self.log.tie else "runner-up") + (
                why if self.log.final_ratio or self.log.tie else ""
            )
        best = score(winner, self.goal)
        unit = "items/s" if self.goal == "throughput" else "ms"
        for key, m in self._best_ok.items():
            if key in self.log.verdicts:
                continue
            value = m.throughput if self.goal == "throughput" else -score(m, self.goal)
            target = winner.throughput if self.goal == "throughput" else -best
            self.log.verdicts[key] = f"slower ({value:.4g} vs {target:.4g} {unit})"

    def _nothing_met(self) -> str:
        kinds = {self.constraints.limit_kind(m) for m in self.log.measurements}
        names = {
            "memory": f"the memory limit ({self.constraints.max_memory_mb:.0f} MB)"
            if self.constraints.max_memory_mb
            else "memory",
            "sla": f"the p99 SLA ({self.constraints.p99_ms:g} ms)" if self.constraints.p99_ms else "the SLA",
            "quality": f"the quality tolerance ({self.constraints.quality})",
            "unsupported": "support on this device",
            "error": "running without errors",
        }
        met = ", ".join(names[k] for k in sorted(k for k in kinds if k))
        return f"no plan met every limit; what stopped them: {met}. Loosen that limit or widen the search."


@dataclass(frozen=True, kw_only=True, slots=True)
class FinalDecision:
    """The final between the two best candidates: who won, and whether the lead is a tie."""

    winner: Measurement
    runner_up: Measurement
    tie: bool  # the lead was within the noise
    ratio: str | None = None  # the paired ratio, in words (measured side by side)


def decide_final(first: Measurement, second: Measurement, *, goal: Goal, noise_floor: float) -> FinalDecision:
    """The final of two measurements, `first` ahead by score. Measured side by side: by the paired
    ratio of their rounds (the rounds' order wins over the pooled figures when they disagree);
    else by the lead against the runs' noise."""
    if not (first.rates and second.rates):
        tie = _lead(first, second, goal) < _noise(first, second, noise_floor)
        return FinalDecision(winner=first, runner_up=second, tie=tie)
    ratio = _paired(first, second, noise_floor)
    if ratio.verdict == "slower":
        first, second = second, first
        ratio = _paired(first, second, noise_floor)
    return FinalDecision(
        winner=first,
        runner_up=second,
        tie=not ratio.decided,
        ratio=f"{first.candidate.key} over {second.candidate.key}: {ratio.reason}",
    )


def _paired(a: Measurement, b: Measurement, noise_floor: float) -> Ratio:
    n = min(len(a.rates), len(b.rates))
    ua, ub = list(a.usable) or [True] * n, list(b.usable) or [True] * n
    ratio = paired_ratio(a.rates[:n], b.rates[:n], [x and y for x, y in zip(ua[:n], ub[:n])], threshold=noise_floor)
    return check_overlap(ratio, [r for r, u in zip(a.rates, ua) if u], [r for r, u in zip(b.rates, ub) if u])


def _lead(a: Measurement, b: Measurement, goal: Goal) -> float:
    """How far a is ahead of b, relative (negative when behind)."""
    return (score(a, goal) - score(b, goal)) / max(abs(score(a, goal)), 1e-12)


def _noise(a: Measurement, b: Measurement, noise_floor: float) -> float:
    return max(noise_floor, 2 * max(a.cv, b.cv))


def _fmt(m: Measurement) -> str:
    if m.throughput is not None and m.p99_ms is not None:
        return f"{m.throughput:.4g}/s, p99 {m.p99_ms:.4g} ms"
    return m.status


def _distinct(ms: list[Measurement]) -> list[Measurement]:
    seen, out = set(), []
    for m in ms:
        if m.candidate.key not in seen:
            seen.add(m.candidate.key)
            out.append(m)
    return out
