"""Where each optimizer step's time goes: data, forward, backward, optimizer, and the gradient
communication. Pure: the clock and the device sync are injected (`torch.cuda.synchronize` on
GPUs, so a mark reads the clock after the phase's kernels ran, not when they were queued).

A step is the StepTimer's step (accelab.train.timing): from the end of the previous step (or the
timer's restart after a pause or a bench turn) to the end of this one. The loop marks the end of
each phase; a phase's time runs from the previous mark to its own, summed over the step's
accumulation micro-steps:

    data       waiting for the next batch (the loader, its workers, accelerate's slicing)
    forward    the forward pass and the loss
    backward   backward, with the DDP all-reduce that has not finished when it ends
    optimizer  gradient clipping, the optimizer step, the LR schedule and zero_grad
    other      the rest: the loss reduction across ranks (a sync point), logging, the turn gate

so the five add up to the step exactly. Communication is measured where it happens and is never
added: DDP all-reduces gradient buckets while backward still runs, so its time (the wall time
with at least one bucket's all-reduce in flight, `split_probes.time_allreduce`) overlaps the
backward phase; with FSDP the all-gathers and reduce-scatters run inside forward and backward,
and are not told apart from them here.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

Phase = Literal["data", "forward", "backward", "optimizer", "other"]
PHASES: tuple[Phase, ...] = ("data", "forward", "backward", "optimizer", "other")
SHORT: dict[Phase, str] = {"data": "data", "forward": "fwd", "backward": "bwd", "optimizer": "opt", "other": "other"}
# where the gradient communication happens, by how the ranks share the model
Comm = Literal["none", "ddp", "fsdp"]
COMM_NOTES: dict[Comm, str] = {
    "none": "one process: no gradient communication",
    "ddp": "communication (overlapped with backward): wall time with a DDP gradient all-reduce in flight",
    "fsdp": "communication: FSDP's all-gathers and reduce-scatters run inside forward and backward (not split out)",
}


@dataclass(kw_only=True, slots=True)
class StepSplit:
    """Per-step phase times; `steps[i]` is the i-th optimizer step's seconds by phase."""

    clock: Callable[[], float] = time.perf_counter
    sync: Callable[[], None] = lambda: None
    comm: Comm = "none"
    steps: list[dict[str, float]] = field(default_factory=list)
    comm_s: list[float] = field(default_factory=list)  # per step: seconds with an all-reduce in flight (ddp)
    forward_flops_per_sample: float | None = None  # one forward of one sample (split_probes)
    probed: bool = False  # split_probes.probe ran (the comm hook, the FLOPs count): once per run
    _current: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    _intervals: list[tuple[float, float]] = field(default_factory=list)  # this step's all-reduces
    _last: float | None = None

    def restart(self, at: float) -> None:
        """A step starts at `at` (the StepTimer's clock reading): what was marked since the last
        step ended is dropped, as the timer drops it (a pause, a wait for a bench turn)."""
        self._last = at
        self._current = dict.fromkeys(PHASES, 0.0)
        self._intervals = []

    def mark(self, phase: Phase) -> None:
        """`phase` ended now: the time since the previous mark is its."""
        assert self._last is not None, "StepSplit.restart() first (StepTimer.start does it)"
        self.sync()
        now = self.clock()
        self._current[phase] += now - self._last
        self._last = now

    def comm_started(self) -> float:
        return self.clock()

    def comm_done(self, started: float) -> None:
        """One all-reduce ran from `started` to now (called from the process group's thread)."""
        self._intervals.append((started, self.clock()))

    def step_done(self, at: float) -> None:
        """The step ended at `at` (the StepTimer's reading): what is left since the last mark is "other"."""
        assert self._last is not None, "StepSplit.restart() first (StepTimer.start does it)"
        self._current["other"] += at - self._last
        self.steps.append(self._current)
        self.comm_s.append(union_seconds(self._intervals))
        self.restart(at)

    def summary(self, warmup: int) -> dict[str, Any] | None:
        """The timed steps' split (the first `warmup` steps left out, as for samples/s)."""
        return summarize_split(
            self.steps[warmup:],
            self.comm_s[warmup:] if self.comm == "ddp" else None,
            comm=self.comm,
            forward_flops_per_sample=self.forward_flops_per_sample,
        )


def comm_of(world_size: int, sharding: str) -> Comm:
    """Where a run's gradient communication happens: none with one process, else its sharding's."""
    if world_size == 1:
        return "none"
    return "fsdp" if sharding == "fsdp" else "ddp"


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Wall time covered by at least one of the (start, end) intervals: overlapping all-reduces
    (DDP launches a bucket while earlier ones are still in flight) count once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def summarize_split(
    steps: list[dict[str, float]],
    comm_s: list[float] | None,
    *,
    comm: Comm = "none",
    forward_flops_per_sample: float | None = None,
) -> dict[str, Any] | None:
    """Per phase: the median ms over the steps, and its share of their summed time (shares add up
    to 1, as the phases add up to each step). Communication the same, as a share it overlaps."""
    if not steps:
        return None
    total = sum(sum(s.values()) for s in steps)
    phases = {
        p: {"p50_ms": statistics.median(s[p] for s in steps) * 1000, "share": _share(sum(s[p] for s in steps), total)}
        for p in PHASES
    }
    communication = None
    if comm_s:
        communication = {"p50_ms": statistics.median(comm_s) * 1000, "share": _share(sum(comm_s), total)}
    return {
        "steps": len(steps),
        "total_s": total,
        "step_p50_ms": statistics.median(sum(s.values()) for s in steps) * 1000,
        "phases": phases,
        "communication": communication,
        "comm": comm,
        "comm_note": COMM_NOTES[comm],
        "forward_flops_per_sample": forward_flops_per_sample,
    }


def _share(part: float, total: float) -> float:
    return part / total if total > 0 else 0.0


def split_text(split: dict[str, Any] | None) -> str:
    """ "data 2% · fwd 31% · bwd 55% · opt 12%": every phase of 1% or more, then the overlapped
    communication ("comm 20% in bwd") or where FSDP's is ("comm in fwd/bwd")."""
    if not split:
        return "-"
    parts = [
        f"{SHORT[p]} {split['phases'][p]['share']:.0%}"
        for p in PHASES
        if p != "other" or split["phases"][p]["share"] >= 0.01
    ]
    if split.get("communication"):
        parts.append(f"comm {split['communication']['share']:.0%} in bwd")
    elif split.get("comm") == "fsdp":
        parts.append("comm in fwd/bwd")
    return " · ".join(parts)


def split_shares(split: dict[str, Any] | None) -> dict[str, float | None] | None:
    """Each phase's share of the step, and the overlapped communication's (None where it is not
    measured), for `train --bench --json`'s rows."""
    if not split:
        return None
    shares: dict[str, float | None] = {p: split["phases"][p]["share"] for p in PHASES}
    shares["communication"] = split["communication"]["share"] if split.get("communication") else None
    return shares
