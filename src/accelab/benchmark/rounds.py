"""Plans measured in alternating rounds, each in its own warm child, so a busy minute hits every
plan alike.

Why: on a shared machine the noise comes in bursts of seconds to minutes. Measured one after
another, plan A can get the quiet minute and plan B the busy one, and the table says "B is 3x
slower". Here every plan is loaded first (one child each, one after another, so a compile's
first-call time is its own), then the plans take turns in short rounds, A B C, C B A, A B C ...
(pyperf and hyperfine interleave for the same reason). The machine's noise is measured around
every turn (`accelab.measure.noise`); a turn in an unreliable window is left out, and the
speed-up of a plan is the paired ratio of its rounds against the reference plan's rounds of the
same index (`accelab.measure.paired`), with a confidence interval. While too few rounds were
quiet enough, a few more are run (the burst may pass); a row that never got enough says so.

A plan past its time budget (`accelab.measure.budget`) is stopped and its row says how long it
ran; a plan that breaks (error, OOM, crash) is a row with its reason, and the others go on.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from rich.console import Console
from rich.markup import escape

from accelab.benchmark.child import BenchJob, Finish, Load, Round, RoundDone
from accelab.benchmark.contenders import Contender, RoundsConfig, needs_more, paired_usable, turn_order
from accelab.catalog.spec import ModelSpec
from accelab.measure import noise
from accelab.measure.budget import PlanBudget
from accelab.measure.capabilities import plan_techniques
from accelab.measure.environment import environment, fingerprint
from accelab.measure.paired import check_overlap, paired_ratio, unpaired_ratio
from accelab.measure.runner import ChildOutcome
from accelab.measure.session import WarmChild
from accelab.plan.plan import Plan
from accelab.quality.collect import QualityConfig
from accelab.quality.verify import judge_outputs, reference_outputs
from accelab.results import contract as K
from accelab.results.result import Result, command_line
from accelab.scenarios.workload import Workload, resolve_batch_size

log = logging.getLogger(__name__)


class Driver:
    """Runs the contenders: load each, alternate their rounds, finish each (module docstring)."""

    def __init__(
        self,
        contenders: list[Contender],
        *,
        config: RoundsConfig,
        timeout_s: float,
        budget: PlanBudget,
        console: Console,
        env: dict[str, str] | None = None,
    ) -> None:
        self.contenders, self.config, self.timeout_s = contenders, config, timeout_s
        self.budget, self.console, self.env = budget, console, env or {}

    def run(self) -> None:
        try:
            if self.config.sequential:
                self._one_at_a_time()
                return
            reference_s: float | None = None
            for i, c in enumerate(self.contenders, 1):
                self._load(i, c, reference_s)
                if reference_s is None and c.loaded is not None and c.loaded.status == "ok":
                    # the first plan that runs is the others' yardstick: its load and its measuring time
                    reference_s = c.used_s + c.workload.min_seconds
            self._rounds(self.contenders)
            for c in self.contenders:
                if c.active:
                    self._finish(c)
        finally:
            for c in self.contenders:
                if c.child is not None:
                    c.child.close()

    def _rounds(self, contenders: list[Contender]) -> None:
        index = 0
        while index < self.config.rounds or (
            index < self.config.rounds + self.config.extra and needs_more(contenders, self.config)
        ):
            if not any(c.active for c in contenders):
                break
            self._round(index, contenders)
            index += 1

    def _one_at_a_time(self) -> None:
        """--sequential: each plan loaded, measured in its rounds and closed before the next."""
        reference_s: float | None = None
        for i, c in enumerate(self.contenders, 1):
            self._load(i, c, reference_s)
            if c.active:
                self._rounds([c])
            if c.active:
                self._finish(c)
            if reference_s is None and c.output is not None:
                reference_s = c.used_s

    def _limit(self, c: Contender) -> float:
        limit = self.timeout_s - c.used_s
        return min(limit, c.budget_s - c.used_s) if c.budget_s else limit

    def _call(self, c: Contender, request: Any) -> ChildOutcome:
        assert c.child is not None
        outcome = c.child.call(request, timeout_s=max(self._limit(c), 1.0))
        c.used_s += outcome.wall_seconds
        if outcome.status == "timeout" and c.budget_s and c.budget_s < self.timeout_s:
            c.stopped = self.budget.stopped_reason(c.budget_s, c.used_s, c.techniques)
        if not outcome.ok:
            c.failure = outcome
        return outcome

    def _load(self, i: int, c: Contender, reference_s: float | None) -> None:
        c.budget_s = self.budget.seconds_for(c.techniques, reference_s)
        why = self.budget.expected_slow(c.techniques)
        limit = f"; budget {c.budget_s:.0f} s, then stopped" if c.budget_s else ""
        self.console.print(
            f"[dim][{i}/{len(self.contenders)}] {escape(c.job.spec.name)}: plan {escape(c.plan.name)}: loading...[/]"
            + (f" [yellow]expected slow here ({why}){limit}[/]" if why else f"[dim]{limit}[/]" if limit else "")
        )
        c.child = WarmChild("accelab.benchmark.child:BenchChild", c.job, env=self.env)
        started = c.child.start()
        if not started.ok:
            c.failure = started
            return
        outcome = self._call(c, Load())
        if outcome.ok:
            c.loaded = outcome.value

    def _round(self, index: int, contenders: list[Contender]) -> None:
        cells = []
        for position in turn_order(len(contenders), index):
            c = contenders[position]
            if not c.active:
                continue
            assert c.child is not None and c.child.pid is not None
            assert c.loaded is not None
            own = [c.child.pid, *c.loaded.worker_pids]
            with noise.Meter([*own, os.getpid()]) as meter:
                outcome = self._call(c, Round(spec=self.config.spec(c.workload)))
            if outcome.ok:
                done: RoundDone = outcome.value
                c.rounds.append(done)
                c.windows.append(meter.window.with_cv(done.cv) if meter.window is not None else None)
                cells.append((position, f"{escape(c.plan.name)} {done.rate:.4g}", c.windows[-1]))
            time.sleep(self.config.settle_s)
            noise.settle(own)  # its engine's threads idle before the next plan's turn
        cells.sort()
        loudest = noise.worst([w for _, _, w in cells if w is not None])
        state = "quiet" if loudest is None or loudest.level == "quiet" else f"{loudest.level}: {escape(loudest.reason)}"
        total = (
            self.config.rounds
            if index < self.config.rounds
            else f"{self.config.rounds}+{index + 1 - self.config.rounds}"
        )
        self.console.print(f"[dim]  round {index + 1}/{total}: {' · '.join(text for _, text, _ in cells)} ({state})[/]")

    def _finish(self, c: Contender) -> None:
        outcome = self._call(c, Finish(kept=c.kept))
        if outcome.ok:
            c.output = outcome.value
        if c.child is not None:
            c.child.close()


def rounds_record(c: Contender) -> list[dict[str, Any]]:
    """Every turn of a plan, for the store (regress compares runs by their rounds)."""
    out = []
    for i, done in enumerate(c.rounds):
        w = c.windows[i] if i < len(c.windows) else None
        out.append(
            {
                "rate": done.rate,
                "seconds": done.seconds,
                "calls": done.calls,
                "cv": done.cv,
                "used": c.usable(i),
                **(
                    {"steal": w.steal, "others_cores": w.others_cores, "throttled": w.throttled, "level": w.level}
                    if w
                    else {}
                ),
            }
        )
    return out


def speedup_record(c: Contender, reference: Contender, *, paired: bool = True) -> dict[str, Any]:
    """The speed-up of `c` over the reference plan, with its interval and verdict: paired by
    round index when they took turns, else (--sequential) Welch's on their quiet rounds."""
    if not paired:
        mine, theirs = [c.rounds[i].rate for i in c.kept], [reference.rounds[i].rate for i in reference.kept]
        ratio = check_overlap(unpaired_ratio(mine, theirs), mine, theirs)
        return {**ratio.to_dict(), "reference": reference.plan.name, "paired": False}
    usable = paired_usable(c, reference)
    n = len(usable)
    loud = noise.worst([w for w in (*c.windows[:n], *reference.windows[:n]) if w is not None])
    ratio = paired_ratio(
        [r.rate for r in c.rounds[:n]],
        [r.rate for r in reference.rounds[:n]],
        usable,
        why_dropped=f"{loud.reason} in the loudest round" if loud is not None and loud.reason else "",
    )
    ratio = check_overlap(ratio, [c.rounds[i].rate for i in c.kept], [reference.rounds[i].rate for i in reference.kept])
    return {**ratio.to_dict(), "reference": reference.plan.name}


def measure_plans(
    spec: ModelSpec,
    plans: Sequence[Plan],
    workloads: Sequence[Workload],
    *,
    device: str | None,
    quality: QualityConfig | None,
    tolerance: str,
    timeout_s: float,
    kind: str,
    tag: str | None,
    group_id: str | None,
    env: dict[str, str] | None = None,
    budget: PlanBudget | None = None,
    config: RoundsConfig | None = None,
    console: Console | None = None,
) -> list[Result]:
    """Measure every plan in alternating rounds; one Result per plan, in order. With several
    plans, each Result after the first that ran carries its speed-up over it (`speedup`)."""
    contenders = [
        Contender(
            plan=p,
            workload=w,
            techniques=plan_techniques(p),
            job=BenchJob(spec=spec, plan=p, workload=w, device=device, quality=quality),
        )
        for p, w in zip(plans, workloads)
    ]
    config = config or RoundsConfig()
    console = console or Console(stderr=True)
    Driver(
        contenders, config=config, timeout_s=timeout_s, budget=budget or PlanBudget(), console=console, env=env
    ).run()
    reference = next((c for c in contenders if c.output is not None), None)
    results = []
    for c in contenders:
        result = _result(c, kind=kind, tag=tag, group_id=group_id, tolerance=tolerance, timeout_s=timeout_s)
        if result.ok and reference is not None and c is not reference and len(contenders) > 1:
            result.metrics[K.SPEEDUP] = speedup_record(c, reference, paired=not config.sequential)
        results.append(result)
    return results


def result_shell(
    spec: ModelSpec, plan: Plan, workload: Workload, *, kind: str, tag: str | None, group_id: str | None
) -> Result:
    """A Result with everything but the measurement (status "error" until one is filled in)."""
    machine = environment()
    return Result(
        kind=kind,
        status="error",
        model=spec.to_dict(),
        plan=plan.to_dict(),
        workload=workload.to_dict(),
        environment=machine,
        fingerprint=fingerprint(machine),
        command=command_line(),
        tag=tag,
        group_id=group_id,
    )


def _result(
    c: Contender, *, kind: str, tag: str | None, group_id: str | None, tolerance: str, timeout_s: float
) -> Result:
    """The plan's Result: what its child finished with (and the quality of its outputs against the
    fp32 reference), or why it did not finish."""
    spec, quality = c.job.spec, c.job.quality
    result = result_shell(spec, c.plan, c.workload, kind=kind, tag=tag, group_id=group_id)
    if c.output is not None:
        output = c.output
        result.status = output.status
        result.metrics, result.notes, result.reason = output.metrics, output.notes, output.reason
        result.metrics[K.NOISE] = noise.summary(
            [w for w in c.windows if w is not None], [c.usable(i) for i, w in enumerate(c.windows) if w is not None]
        )
        result.metrics[K.ROUNDS] = rounds_record(c)
        if quality is not None and output.outputs is not None:
            reference = reference_outputs(spec, quality, device=c.job.device, timeout_s=timeout_s)
            result.quality = judge_outputs(spec.task, reference, output.outputs, tolerance)
    elif c.loaded is not None and c.loaded.status != "ok":
        result.status, result.reason = c.loaded.status, c.loaded.reason
    elif c.failure is not None:
        result.status = "stopped" if c.stopped else c.failure.status
        result.reason = c.stopped or c.failure.reason
        if c.failure.traceback:
            result.metrics = {K.TRACEBACK: c.failure.traceback}
    return result


def with_rows(workload: Workload, plans: Sequence[Plan]) -> list[Workload]:
    """compare's rule: each plan runs at its own batch_size when it has one, else the shared one."""
    return [replace(workload, batch_size=resolve_batch_size(None, p, workload.batch_size)) for p in plans]
