"""How long one plan (a compare row, a train --bench row) may run before it is stopped as too
slow: `--max-seconds-per-plan` when given; otherwise only plans the capability report expects
slow here (a technique its probe measured slower than fp32) get a budget, 3x the reference
plan's own time (at least a minute), so a 0.04x plan costs minutes of nobody's time. A stopped
plan is an answer, not a failure: its row says "stopped: too slow, ran 92 s of its 90 s budget"
with the measured reason. (The budget is announced as "budget 90 s, then stopped" before the plan
runs: a limit, not a time it took.)
Pure: the slow techniques come in from `capabilities.slow_techniques`."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

FLOOR_S = 60.0
REFERENCE_FACTOR = 3.0


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanBudget:
    explicit_s: float | None = None  # --max-seconds-per-plan
    slow: dict[str, str] = field(default_factory=dict)  # technique -> why it is expected slow here
    floor_s: float = FLOOR_S
    factor: float = REFERENCE_FACTOR

    def __post_init__(self) -> None:
        if self.explicit_s is not None and self.explicit_s <= 0:
            raise ValueError(f"--max-seconds-per-plan {self.explicit_s} must be more than 0 seconds")

    def expected_slow(self, techniques: Iterable[str]) -> str | None:
        """Why a plan using `techniques` is expected slow here, or None."""
        return next((f"{t}: {self.slow[t]}" for t in techniques if t in self.slow), None)

    def seconds_for(self, techniques: Iterable[str], reference_s: float | None) -> float | None:
        """The budget of a plan, or None (no budget beyond the run's own --timeout)."""
        if self.explicit_s is not None:
            return self.explicit_s
        if self.expected_slow(techniques) is not None and reference_s:
            return max(self.floor_s, self.factor * reference_s)
        return None

    def announcement(self, techniques: Iterable[str], reference: str = "the first plan's") -> str | None:
        """What a plan's start line says of its budget before it runs (a limit, not a time it
        took), or None when it has none: "budget 90 s, then stopped", or for a plan expected slow
        before the reference has run, "budget 3x the first plan's time (at least 60 s), then stopped"."""
        why = self.expected_slow(techniques)
        if self.explicit_s is not None:
            limit = f"budget {self.explicit_s:.0f} s, then stopped"
        elif why is not None:
            limit = f"budget {self.factor:g}x {reference} time (at least {self.floor_s:.0f} s), then stopped"
        else:
            return None
        return f"expected slow here ({why}); {limit}" if why else limit

    def stopped_reason(self, budget_s: float, ran_s: float, techniques: Iterable[str]) -> str:
        """What a stopped row says: its budget and how long it had run (loading included)."""
        why = self.expected_slow(techniques)
        return f"stopped: too slow, ran {ran_s:.0f} s of its {budget_s:.0f} s budget" + (
            f" (expected: {why})" if why else ""
        )
