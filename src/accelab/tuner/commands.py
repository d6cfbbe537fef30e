"""`accelab tune`: the fastest plan that fits the limits, written as a Plan file."""

from __future__ import annotations

from typing import Any

import typer

from accelab.options import command, fields_of
from accelab.tuner.options import TuneOptions, serve_tune_request, tune_request

MODEL_HELP = "Catalog name, local directory, .gguf file, Hub id, or your own model as package.module:callable."


def register(app: typer.Typer) -> None:
    app.command("tune")(tune_command)


@command(TuneOptions)
def tune_command(model: str = typer.Argument(..., help=MODEL_HELP), **options: Any) -> None:
    """Search the plan space for a goal under memory, latency and quality limits; write the best Plan."""
    asked = TuneOptions(**fields_of(TuneOptions, options))
    if asked.scenario == "serve":
        from accelab.results.result import command_line
        from accelab.tuner.serve_report import tune_serve

        found = tune_serve(serve_tune_request(model, asked), command=command_line()).plan is not None
    else:
        from accelab.tuner.run import tune

        found = tune(tune_request(model, asked)).plan is not None
    if not found:  # no plan met every limit
        raise typer.Exit(3)
