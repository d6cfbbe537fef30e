"""`accelab train --tune`'s tables and its plan file."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from accelab.results import contract as K
from accelab.results.result import Result
from accelab.results.table import speedup_text
from accelab.train.plan_file import SETTABLE, TrainPlan
from accelab.train.report import memory_cell, quality_cell
from accelab.train.tune import BASELINE, Judged, TuneOutcome


def _speedup(result: Result) -> str:
    paired = result.metrics.get(K.SPEEDUP)
    if not isinstance(paired, dict):
        return "-"
    return speedup_text(paired.get("value"), paired.get("low"), paired.get("high"), paired.get("verdict"))


def _sps(result: Result) -> str:
    value = result.metrics.get(K.SAMPLES_PER_S)
    return f"{value:.1f}" if value else "-"


def screening_table(outcome: TuneOutcome, console: Console) -> None:
    table = Table(title="screening: short runs taking turns", title_justify="left")
    for column in ("plan", "samples/s", "vs baseline", "peak memory", "next"):
        table.add_column(column, justify="right" if column in ("samples/s", "vs baseline") else "left")
    for s, r in zip(outcome.screened, outcome.screen_results):
        ok = r.ok
        next_step = "reference" if s.candidate.name == BASELINE else (s.out or "finalist")
        table.add_row(
            s.candidate.name,
            _sps(r) if ok else "-",
            _speedup(r) if ok else "-",
            memory_cell(r.metrics) if ok else "-",
            next_step,
        )
    console.print(table)


def _ttt(j: Judged) -> str:
    return f"{j.time_to_target_s:.1f} s" if j.time_to_target_s is not None else "not reached"


def finalists_table(outcome: TuneOutcome, console: Console) -> None:
    target = (
        f"{outcome.target:.2%}" if outcome.metric == "accuracy" and outcome.target is not None else f"{outcome.target}"
    )
    table = Table(
        title=f"finalists: trained to convergence; target: the worse baseline seed's final {outcome.metric} "
        f"less the seeds' spread, {target}",
        title_justify="left",
    )
    for column in ("plan", "samples/s", "memory", "time-to-target", "final", "convergence", "result"):
        table.add_column(column, justify="left" if column in ("plan", "convergence", "result") else "right")
    for j in outcome.judged:
        r = j.result
        result = "winner" if j is outcome.winner else (j.out or "")
        if not r.ok:
            table.add_row(r.plan["name"], "-", "-", "-", "-", j.verdict, j.reason)
            continue
        table.add_row(
            r.plan["name"], _sps(r), memory_cell(r.metrics), _ttt(j), quality_cell(r.metrics), j.verdict, result
        )
    console.print(table)
    for j in outcome.judged:
        if j.verdict == "baseline" or not j.result.ok:
            continue
        console.print(
            f"{j.result.plan['name']}: {j.verdict}: {j.reason}; samples/s vs baseline {_speedup(j.result)}; "
            f"final {outcome.metric} vs the seeds {j.eval_difference or '-'}",
            style="dim",
        )


def plan_of(outcome: TuneOutcome, base: dict[str, Any], model: str, dataset: str) -> TrainPlan | None:
    """The winner as a train plan: the baseline's settings with the winner's changes."""
    winner = outcome.winner
    if winner is None:
        return None
    changes = {k: v for k, v in winner.candidate.changes.items() if k in SETTABLE}
    train = {k: base[k] for k in SETTABLE if k in base and base[k] is not None}
    train.update(changes)
    m = winner.result.metrics
    speedup = m.get(K.SPEEDUP) or {}
    return TrainPlan(
        name=winner.candidate.name,
        train=train,
        nproc=winner.candidate.nproc,
        model=model,
        dataset=dataset,
        measured={
            "samples_per_s": m.get(K.SAMPLES_PER_S),
            "speedup_vs_baseline": speedup.get("value"),
            "time_to_target_s": winner.time_to_target_s,
            "target": {outcome.metric: outcome.target},
            "convergence": winner.verdict,
            "final_eval": {outcome.metric: (m.get(K.EVALS) or [{}])[-1].get(outcome.metric)},
        },
    )


def write_plan(plan: TrainPlan, path: Path, command: str) -> None:
    header = (
        f"accelab train plan, written by `accelab train --tune` on {dt.date.today().isoformat()}\n"
        f"reproduce: {command}\n"
        f"train with it: accelab train --model {plan.model} --dataset {plan.dataset} --plan {path}"
    )
    path.write_text(plan.to_yaml(header))
