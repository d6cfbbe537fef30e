"""`accelab predict`: batch inference over a folder of images, a file of texts or a saved dataset."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import typer

from accelab.launch import LaunchOptions, outcome_elsewhere, refuse_outer_launcher
from accelab.options import Output, command, fields_of, values_of
from accelab.predict.config import PredictConfig, PredictRun

MODEL_HELP = "Catalog name, user model, local directory, .gguf file or Hub id."


def register(app: typer.Typer) -> None:
    app.command("predict")(predict_command)


@command(PredictRun, PredictConfig, LaunchOptions, Output)
def predict_command(model: str = typer.Argument(..., help=MODEL_HELP), **options: Any) -> None:
    """Run a model over a whole dataset with a plan, in one process or many; resumable, ordered output."""
    refuse_outer_launcher("predict")

    from accelab.plan.runtime import Unsupported
    from accelab.plan.techniques.system import available_cpus
    from accelab.predict import launch as launcher
    from accelab.predict.options import build_request
    from accelab.predict.report import print_run, result_of
    from accelab.results.store import keep

    launch = LaunchOptions.from_options(options)
    output = Output(**fields_of(Output, options))
    run = PredictRun(**fields_of(PredictRun, options))
    try:
        request = build_request(
            model, run, given=values_of(PredictConfig, options), launch=launch, cpus=available_cpus()
        )
    except Unsupported as err:  # a plan technique that cannot run here: said before any model loads
        typer.secho(f"unsupported: {err}", fg=typer.colors.RED, err=True)
        raise typer.Exit(3) from None
    if request.resuming:
        typer.secho(f"resuming: {request.resuming:,} of {request.config.source_items:,} items are done", err=True)
    outcome = None
    try:
        with tempfile.TemporaryDirectory(prefix="accelab-predict-") as work_dir:
            outcome = launcher.run(request.config, launch, work_dir=Path(work_dir), threads=request.threads)
        result = result_of(request, outcome, tag=output.tag)
    except Unsupported as err:
        result = result_of(request, None, unsupported=str(err), tag=output.tag)
    if outcome_elsewhere(outcome):
        return
    print_run(result)
    keep(result, json_out=output.json_out, store=output.store, db=output.db)
    if not result.ok:
        raise typer.Exit(3 if result.status == "unsupported" else 1)
