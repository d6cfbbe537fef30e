"""The plans that take turns in `rounds`, and the rules of the turns, apart from the children that
run them: how a run is split into rounds (RoundsConfig), who goes first in a round (A B C, then
C B A), what each plan holds so far (its rounds and the machine's noise around each), which of
its rounds are quiet enough to count, and whether a few more rounds are needed because too few
were. Pure: no processes, no clock."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from accelab.benchmark.child import BenchJob, BenchOutput, Loaded, RoundDone
from accelab.measure import noise
from accelab.measure.paired import MIN_PAIRS
from accelab.measure.runner import ChildOutcome
from accelab.measure.session import WarmChild
from accelab.plan.plan import Plan
from accelab.scenarios.workload import RoundSpec, Workload


@dataclass(frozen=True, kw_only=True, slots=True)
class RoundsConfig:
    """How a run is split into turns."""

    rounds: int = 6  # turns per plan; the workload's min_seconds / min_iters are shared among them
    extra: int = 6  # at most this many more rounds while too few were quiet enough
    min_usable: int = MIN_PAIRS  # quiet rounds (pairs, when comparing) a figure needs
    settle_s: float = 0.05  # pause between two turns: the last plan's worker threads go idle
    sequential: bool = False  # one plan at a time, each alone in memory; speed-ups then unpaired (Welch)

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"rounds={self.rounds} must be 1 or more")
        if self.extra < 0:
            raise ValueError(f"extra rounds={self.extra} must be 0 or more")

    @classmethod
    def single(cls) -> RoundsConfig:
        """One plan (bench): fewer, longer rounds; noise still measured and noisy rounds dropped."""
        return cls(rounds=3, extra=3, min_usable=2)

    def spec(self, workload: Workload) -> RoundSpec:
        return RoundSpec(
            min_iters=max(1, math.ceil(workload.min_iters / self.rounds)),
            min_seconds=workload.min_seconds / self.rounds,
            max_seconds=max(workload.max_seconds / self.rounds, 1.0),
        )


def turn_order(n: int, round_index: int) -> list[int]:
    """A B C in even rounds, C B A in odd ones: no plan always goes first after a pause."""
    order = list(range(n))
    return order if round_index % 2 == 0 else order[::-1]


@dataclass(kw_only=True)
class Contender:
    plan: Plan
    workload: Workload
    job: BenchJob
    techniques: list[str] = field(default_factory=list)
    budget_s: float | None = None  # --max-seconds-per-plan or the slow-plan budget
    child: WarmChild | None = None
    loaded: Loaded | None = None
    failure: ChildOutcome | None = None
    stopped: str | None = None  # why it was stopped as too slow
    used_s: float = 0.0  # its load and turns so far
    rounds: list[RoundDone] = field(default_factory=list)
    windows: list[noise.Window | None] = field(default_factory=list)
    output: BenchOutput | None = None

    @property
    def active(self) -> bool:
        return self.loaded is not None and self.loaded.status == "ok" and self.failure is None and self.output is None

    def quiet(self, index: int) -> bool:
        """The round's window was not unreliable (or was not measured)."""
        w = self.windows[index] if index < len(self.windows) else None
        return w is None or w.level != "unreliable"

    @property
    def quiet_rounds(self) -> tuple[int, ...]:
        return tuple(i for i in range(len(self.rounds)) if self.quiet(i))

    @property
    def kept(self) -> tuple[int, ...]:
        """The rounds its figures come from: the quiet ones, and when they hold fewer calls than
        --min-iters (the extra rounds ran out on a loud machine), the least loud of the dropped
        ones until the calls reach it: --min-iters is a floor, and the row's noise record then
        says it is unreliable (it is as loud as the loudest round it kept)."""
        kept = list(self.quiet_rounds)
        missing = self.workload.min_iters - sum(self.rounds[i].calls for i in kept)
        loud = sorted((i for i in range(len(self.rounds)) if i not in kept), key=self._loudness)
        for i in loud:
            if missing <= 0:
                break
            kept.append(i)
            missing -= self.rounds[i].calls
        return tuple(sorted(kept))

    def _loudness(self, index: int) -> float:
        w = self.windows[index] if index < len(self.windows) else None
        return noise.loudness(w) if w is not None else 0.0

    def usable(self, index: int) -> bool:
        return index in self.kept

    @property
    def short_of_calls(self) -> bool:
        """Its quiet rounds hold fewer calls than --min-iters asked for (noisy rounds are dropped)."""
        return sum(self.rounds[i].calls for i in self.quiet_rounds) < self.workload.min_iters


def paired_usable(a: Contender, b: Contender) -> list[bool]:
    n = min(len(a.rounds), len(b.rounds))
    return [a.quiet(i) and b.quiet(i) for i in range(n)]


def needs_more(contenders: Sequence[Contender], config: RoundsConfig) -> bool:
    """Too few quiet rounds for a figure (of the only plan, or of a plan paired with the reference),
    or too few calls in them for --min-iters."""
    active = [c for c in contenders if c.active]
    if not active:
        return False
    if any(c.short_of_calls for c in active):
        return True
    if len(contenders) == 1:
        return len(active[0].quiet_rounds) < config.min_usable
    reference = next((c for c in contenders if c.loaded is not None and c.loaded.status == "ok"), None)
    if reference is None or not reference.active:
        return False
    return any(sum(paired_usable(c, reference)) < config.min_usable for c in active if c is not reference)
