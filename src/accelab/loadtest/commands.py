"""`accelab loadtest URL`: open- or closed-loop load against an OpenAI-compatible server;
latency percentiles, throughput, goodput under SLOs, and the highest rate that meets them."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    app.command("loadtest")(loadtest_command)


def loadtest_command(
    ctx: typer.Context,
    url: str = typer.Argument(..., help="Server base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)."),
    endpoint: str = typer.Option("chat", help="chat | completions | embeddings."),
    model: str | None = typer.Option(None, help="Model id to send (default: the first of /v1/models)."),
    rate: float | None = typer.Option(None, help="Open loop: requests per second (the start rate of --find-max)."),
    concurrency: int | None = typer.Option(
        None, help="Closed loop: users, each sending its next request when the last one answered."
    ),
    burstiness: float = typer.Option(1.0, help="Open-loop arrivals: gamma shape; 1 = Poisson, <1 burstier."),
    duration: float = typer.Option(30.0, help="Seconds of sending per run (each find-max probe is one run)."),
    requests: int | None = typer.Option(None, help="Most requests per run (with --duration, whichever first)."),
    warmup: int = typer.Option(2, help="Requests sent first and left out of the numbers."),
    max_tokens: str = typer.Option(
        "32",
        "--max-tokens",
        help="max_tokens of each generation request; a list "
        "(16,128,32,96) mixes short and long answers, request i asking for item i mod n.",
    ),
    stream: bool = typer.Option(True, "--stream/--no-stream", help="Stream generations (needed for TTFT/ITL)."),
    timeout: float = typer.Option(60.0, help="Seconds before one request counts as failed."),
    slo: str | None = typer.Option(
        None,
        help="Per-request objectives, e.g. ttft=500ms,e2e=2s (keys: ttft, "
        "tpot, e2e); goodput counts requests meeting all.",
    ),
    find_max_: bool = typer.Option(
        False,
        "--find-max",
        help="Search the highest rate whose goodput meets --goodput-target (doubling, then bisection).",
    ),
    goodput_target: float = typer.Option(
        0.95, "--goodput-target", help="Fraction of requests that must meet the SLO for a rate to pass."
    ),
    max_steps: int = typer.Option(8, "--max-steps", help="Most runs a --find-max search makes."),
    cooldown: float = typer.Option(2.0, help="Seconds of quiet between --find-max runs (the server sheds a backlog)."),
    max_in_flight: int = typer.Option(
        1024,
        "--max-in-flight",
        help="Open loop: an arrival finding this many "
        "requests unanswered fails at once instead of opening another connection.",
    ),
    prompts_file: Path | None = typer.Option(
        None,
        "--prompts-file",
        help="Inputs to send: a JSON list of strings or one per line (default: accelab's sample prompts / sentences).",
    ),
    images: str | None = typer.Option(
        None,
        "--images",
        help="Chat: send images after each prompt: sample[:N] (accelab's photos, a repeated pool), "
        "generated[:N] (distinct random images) or a folder of PNG / JPEG / WebP files.",
    ),
    images_per_request: int = typer.Option(1, "--images-per-request", help="Images in each chat request."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="ACCELAB_API_KEY", show_envvar=True),
    seed: int = typer.Option(0, help="Seed of the arrival schedule."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the Result as JSON to this file."),
    plot: Path | None = typer.Option(
        None, "--plot", help="PNG: latency CDF (one run) or latency and goodput against offered load (--find-max)."
    ),
    db: Path | None = typer.Option(None, help="Results store (SQLite); default in the cache dir."),
    tag: str | None = typer.Option(None, help="Label this run."),
    store: bool = typer.Option(True, "--store/--no-store", help="Append the run to the results store."),
) -> None:
    """Load-test a server: TTFT, TPOT, ITL and end-to-end percentiles, throughput, goodput."""
    from accelab.loadtest.run import LoadTestRequest, run_loadtest
    from accelab.results.store import keep

    result = run_loadtest(LoadTestRequest.from_options(ctx.params))
    keep(result, json_out=json_out, store=store, db=db)
