"""Who wins a serving tune at one load level: each candidate's windows, round by round, and the
ranking by median goodput among those not excluded (quality, memory, a failed start), with why
every other one lost. A runner-up within 3% of the winner, paired round by round (the same
minute of the machine), is a tie. Pure: no servers, no store."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from accelab.plan.plan import Plan
from accelab.results import contract as K
from accelab.tuner.serve_candidates import CandidateServer


@dataclass(kw_only=True, slots=True)
class Candidate:
    key: str
    plan: Plan
    server: CandidateServer | None = None
    quality: str | None = None  # verify's verdict label: pass | warn | fail | cannot tell (...) | None (not checked)
    quality_detail: str = ""
    windows: dict[int, dict[int, dict[str, Any]]] = field(default_factory=dict)  # users -> round -> its row
    excluded: str | None = None  # why it cannot win, whatever it measured
    stored_peak_mb: float = 0.0  # the peak memory its windows in the store recorded (a resumed tune)

    @property
    def peak_rss_mb(self) -> float | None:
        peak = max(self.stored_peak_mb, self.server.peak_rss_mb if self.server else 0.0)
        return peak or None

    def rows(self, users: int) -> list[dict[str, Any]]:
        return [row for _, row in sorted(self.windows.get(users, {}).items())]

    def median(self, users: int, name: str) -> float | None:
        values = [w[name] for w in self.rows(users) if w.get(name) is not None]
        return statistics.median(values) if values else None


@dataclass(kw_only=True, slots=True)
class LevelRanking:
    users: int
    winner: str | None
    order: list[str]  # best first, the excluded last
    why: dict[str, str]  # candidate -> why it lost
    tie_with: str | None = None


def rank(candidates: list[Candidate], users: int) -> LevelRanking:
    """Highest median goodput first among the eligible; a runner-up whose goodput paired round by
    round with the winner's (the same minute of the machine) comes within 3% is a tie."""
    why: dict[str, str] = {}
    eligible = []
    for c in candidates:
        if c.excluded:
            why[c.key] = c.excluded
        elif not c.windows.get(users):
            why[c.key] = "not measured at this load"
        else:
            eligible.append(c)
    eligible.sort(key=lambda c: c.median(users, K.GOODPUT_TOKEN_THROUGHPUT) or 0.0, reverse=True)
    if not eligible or not eligible[0].median(users, K.GOODPUT_TOKEN_THROUGHPUT):
        for c in eligible:
            why[c.key] = "no request met the SLO"
        order = [c.key for c in eligible] + [k for k in why if k not in {c.key for c in eligible}]
        return LevelRanking(users=users, winner=None, order=order, why=why)
    best = eligible[0]
    top = best.median(users, K.GOODPUT_TOKEN_THROUGHPUT) or 0.0
    tie_with = None
    for c in eligible[1:]:
        ratios = paired_ratios(c, best, users)
        mine = c.median(users, K.GOODPUT_TOKEN_THROUGHPUT) or 0.0
        words = f"goodput {mine:.1f} tokens/s, {mine / top:.2f}x the winner's {top:.1f}"
        if ratios:
            words += f" (paired rounds {', '.join(f'{r:.2f}' for r in ratios)})"
        if ratios and abs(statistics.median(ratios) - 1) <= 0.03 and tie_with is None:
            tie_with = c.key
            words += ": a tie within the noise of this machine"
        why[c.key] = words
    order = [c.key for c in eligible] + [k for k in why if k not in {c.key for c in eligible}]
    return LevelRanking(users=users, winner=best.key, order=order, why=why, tie_with=tie_with)


def paired_ratios(a: Candidate, b: Candidate, users: int) -> list[float]:
    """a's goodput over b's, round by round (the same minute of the machine)."""
    mine, theirs = a.windows.get(users, {}), b.windows.get(users, {})
    ratios = []
    for rnd in sorted(set(mine) & set(theirs)):
        x, y = mine[rnd].get(K.GOODPUT_TOKEN_THROUGHPUT), theirs[rnd].get(K.GOODPUT_TOKEN_THROUGHPUT)
        if x and y:
            ratios.append(x / y)
    return ratios
