"""`accelab tune`: the fastest plan that fits the limits, written as a Plan file."""

from __future__ import annotations

from pathlib import Path

import typer

from accelab.options import as_choice


def register(app: typer.Typer) -> None:
    app.command("tune")(tune_command)


def tune_command(
    model: str = typer.Argument(
        ..., help="Catalog name, local directory, .gguf file, Hub id, or your own model as package.module:callable."
    ),
    goal: str = typer.Option("throughput", help="throughput | latency."),
    percentile: str = typer.Option("p99", help="For --goal latency: p50 | p99."),
    task: str | None = typer.Option(None),
    scenario: str = typer.Option(
        "auto",
        help="forward | generate | auto: plans measured call by call; serve: candidate servers "
        "measured under --concurrency users (with --slo, --rounds, --window, --prompt-file).",
    ),
    batch_size: int | None = typer.Option(
        None,
        "--batch-size",
        "-b",
        help="Latency goal: the request batch (default 1). "
        "Throughput goal: the screening batch (default 8 forward, 4 generate).",
    ),
    max_batch: int | None = typer.Option(
        None, "--max-batch", help="Largest batch tried (default 256 forward, 64 generate)."
    ),
    seq_len: int = typer.Option(128, "--seq-len"),
    new_tokens: int = typer.Option(32, "--new-tokens"),
    image_size: int | None = typer.Option(None, "--image-size"),
    max_memory: str | None = typer.Option(
        None, "--max-memory", help="Peak memory limit: GPU memory, or process RSS on CPU (e.g. 2GiB)."
    ),
    p99_ms: float | None = typer.Option(None, "--p99-ms", help="p99 latency SLA per call, in ms."),
    quality: str = typer.Option(
        "balanced", help="strict | balanced | loose | off: the verify tolerance every plan must meet."
    ),
    budget: str | None = typer.Option(None, help="Wall time for the whole search (e.g. 10m); the best so far wins."),
    include: str | None = typer.Option(None, help="Comma-separated presets to search instead of the default space."),
    exclude: str | None = typer.Option(None, help="Comma-separated presets to leave out."),
    min_seconds: float = typer.Option(3.0, "--min-seconds", help="Length of the final runs."),
    device: str | None = typer.Option(None),
    out: Path = typer.Option(Path("best.yaml"), "--out", help="Where to write the winning Plan."),
    plot: Path | None = typer.Option(None, "--plot", help="Pareto chart PNG (throughput vs p99, memory as colour)."),
    json_out: Path | None = typer.Option(None, "--json"),
    db: Path | None = typer.Option(None),
    fresh: bool = typer.Option(False, "--fresh", help="Ignore earlier measurements of the same tune in the store."),
    concurrency: str = typer.Option(
        "8", "--concurrency", help="--scenario serve: closed-loop users, or levels such as 1,8,16."
    ),
    slo: str | None = typer.Option(
        None,
        "--slo",
        help="--scenario serve: per-request objectives, e.g. ttft_p99=500ms,itl_p99=100ms "
        "(ttft, itl, e2e); goodput counts the output tokens of requests that meet them all.",
    ),
    prompt_file: Path | None = typer.Option(
        None, "--prompt-file", help="--scenario serve: your prompts, a JSON list of strings or one per line."
    ),
    rounds: int = typer.Option(2, "--rounds", help="--scenario serve: rounds of windows per load (A B C ... C B A)."),
    window: float = typer.Option(15.0, "--window", help="--scenario serve: seconds of load per window."),
) -> None:
    """Search the plan space for a goal under memory, latency and quality limits; write the best Plan."""
    from accelab.catalog.resolve import resolve
    from accelab.tuner.run import GOALS, PERCENTILES, TUNE_SCENARIOS, TuneRequest, check_options, tune
    from accelab.tuner.search import QUALITY_LEVELS

    check_options(goal=goal, percentile=percentile, quality=quality, max_memory=max_memory, budget=budget)

    def split(text: str | None) -> list[str] | None:
        return [p.strip() for p in text.split(",") if p.strip()] if text else None

    if scenario == "serve":
        from accelab.loadtest.run import load_inputs
        from accelab.results.result import command_line
        from accelab.tuner.serve_report import tune_serve
        from accelab.tuner.serving import ServeTuneRequest, parse_levels, parse_serve_slo

        request = ServeTuneRequest(
            spec=resolve(model, task),
            model=model,
            concurrency=parse_levels(concurrency),
            slo=parse_serve_slo(slo),
            max_memory=max_memory,
            quality=quality,
            include=tuple(split(include) or ()) or None,
            exclude=tuple(split(exclude) or ()),
            prompts=tuple(load_inputs("chat", prompt_file)) if prompt_file else (),
            rounds=rounds,
            window_s=window,
            device=device,
            out=out,
            json_out=json_out,
            db=db,
            fresh=fresh,
        )
        served = tune_serve(request, command=command_line())
        if served.plan is None:
            raise typer.Exit(3)
        return

    outcome = tune(
        TuneRequest(
            spec=resolve(model, task),
            goal=as_choice(goal, GOALS),
            percentile=as_choice(percentile, PERCENTILES),
            scenario=as_choice(scenario, TUNE_SCENARIOS),
            batch_size=batch_size,
            max_batch=max_batch,
            seq_len=seq_len,
            new_tokens=new_tokens,
            image_size=image_size,
            max_memory=max_memory,
            p99_ms=p99_ms,
            quality=as_choice(quality, QUALITY_LEVELS),
            budget=budget,
            include=split(include),
            exclude=split(exclude),
            min_seconds=min_seconds,
            device=device,
            out=out,
            plot=plot,
            json_out=json_out,
            db=db,
            fresh=fresh,
        )
    )
    if outcome.plan is None:
        raise typer.Exit(3)
