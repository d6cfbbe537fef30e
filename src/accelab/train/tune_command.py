"""`accelab train --tune`: from the command's options to the tables, the stored Results and the plan file."""

from __future__ import annotations

import json
from typing import Any

import typer
from rich.console import Console

from accelab.options import Output
from accelab.results.result import command_line
from accelab.results.store import open_store
from accelab.train.bench_rows import device_facts
from accelab.train.run_options import TrainRun
from accelab.train.tune import TuneSettings, tune
from accelab.train.tune_report import finalists_table, plan_of, screening_table, write_plan
from accelab.train.tune_space import candidates, only
from accelab.units import parse_duration_s, parse_size_mib


def settings_of(run: TrainRun) -> TuneSettings:
    return TuneSettings(
        screen_steps=run.tune_steps,
        epochs=run.tune_epochs,
        finalists=run.finalists,
        max_memory_mib=parse_size_mib(run.max_memory) if run.max_memory else None,
        budget_s=parse_duration_s(run.budget) if run.budget else None,
        timeout_s=run.timeout,
    )


def _space(config: Any, run: TrainRun) -> list:
    """The candidates for this device: its GPUs (or CPU processes) and bf16 support."""
    return candidates(config, **device_facts(config, run.bench_nproc))


def json_doc(outcome: Any, plan: str | None, results: list) -> dict[str, Any]:
    """--json: the winner, the target, every plan's screening and convergence verdicts, the Results."""
    return {
        "winner": outcome.winner.result.plan["name"] if outcome.winner else None,
        "plan": plan,
        "target": {outcome.metric: outcome.target},
        "screening": [
            {"plan": s.candidate.name, "speedup": s.speedup, "verdict": s.verdict, "out": s.out}
            for s in outcome.screened
        ],
        "finalists": [
            {
                "plan": j.result.plan["name"],
                "convergence": j.verdict,
                "reason": j.reason,
                "time_to_target_s": j.time_to_target_s,
                "eval_difference": j.eval_difference,
                "out": j.out,
            }
            for j in outcome.judged
        ],
        "results": [r.to_dict() for r in results],
    }


def tune_command(request: Any, run: TrainRun, output: Output, *, idle: float | None) -> None:
    config = request.config
    if request.launch.nproc != 1 or config.world_size != 1:
        raise typer.BadParameter("--tune chooses the processes itself: drop --nproc", param_hint="--nproc")
    settings = settings_of(run)
    space = only(_space(config, run), run.tune_plans)
    console = Console()
    outcome = tune(
        config, request.spec, space, settings, idle=idle, tag=output.tag, say=lambda line: typer.secho(line, err=True)
    )
    screening_table(outcome, console)
    finalists_table(outcome, console)
    for note in outcome.notes:
        console.print(f"note: {note}", style="yellow")
    results = outcome.screen_results + [j.result for j in outcome.judged]
    if output.store:
        open_store(output.db).add(*results)
    plan = plan_of(outcome, config.to_dict(), run.model, config.dataset or "held-out text")
    if output.json_out:
        doc = json_doc(outcome, plan.name if plan else None, results)
        output.json_out.write_text(json.dumps(doc, indent=2, default=str))
    if plan is None:
        typer.secho(
            "no plan converged like the baseline within the limits; nothing written", fg=typer.colors.RED, err=True
        )
        raise typer.Exit(1)
    write_plan(plan, run.out, command_line())
    typer.secho(
        f"winner: {plan.name}; plan written to {run.out} (train with `accelab train --plan {run.out}`)", err=True
    )
