"""`accelab loadtest URL`: open- or closed-loop load against an OpenAI-compatible server;
latency percentiles, throughput, goodput under SLOs, and the highest rate that meets them."""

from __future__ import annotations

from typing import Any

import typer

from accelab.loadtest.config import LoadOptions
from accelab.options import Output, command, fields_of

URL_HELP = "Server base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)."


def register(app: typer.Typer) -> None:
    app.command("loadtest")(loadtest_command)


@command(LoadOptions, Output)
def loadtest_command(url: str = typer.Argument(..., help=URL_HELP), **options: Any) -> None:
    """Load-test a server: TTFT, TPOT, ITL and end-to-end percentiles, throughput, goodput."""
    from accelab.loadtest.run import LoadTestRequest, run_loadtest
    from accelab.results.store import keep

    output = Output(**fields_of(Output, options))
    result = run_loadtest(LoadTestRequest.from_options({**options, "url": url}))
    keep(result, json_out=output.json_out, store=output.store, db=output.db)
