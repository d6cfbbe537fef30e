"""`accelab tune`: the fastest plan that fits the limits, written as a Plan file."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    app.command("tune")(tune_command)


def tune_command(
    model: str = typer.Argument(..., help="Catalog name, local directory, .gguf file or Hub id."),
    goal: str = typer.Option("throughput", help="throughput | latency."),
    percentile: str = typer.Option("p99", help="For --goal latency: p50 | p99."),
    task: Optional[str] = typer.Option(None),
    scenario: str = typer.Option("auto", help="forward | generate | auto."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", "-b", help="Latency goal: the request batch (default 1). Throughput goal: the screening batch (default 8 forward, 4 generate)."),
    max_batch: Optional[int] = typer.Option(None, "--max-batch", help="Largest batch tried (default 256 forward, 64 generate)."),
    seq_len: int = typer.Option(128, "--seq-len"),
    new_tokens: int = typer.Option(32, "--new-tokens"),
    image_size: Optional[int] = typer.Option(None, "--image-size"),
    max_memory: Optional[str] = typer.Option(None, "--max-memory", help="Peak memory limit: GPU memory, or process RSS on CPU (e.g. 2GiB)."),
    p99_ms: Optional[float] = typer.Option(None, "--p99-ms", help="p99 latency SLA per call, in ms."),
    quality: str = typer.Option("balanced", help="strict | balanced | loose | off: the verify tolerance every plan must meet."),
    budget: Optional[str] = typer.Option(None, help="Wall time for the whole search (e.g. 10m); the best so far wins."),
    include: Optional[str] = typer.Option(None, help="Comma-separated presets to search instead of the default space."),
    exclude: Optional[str] = typer.Option(None, help="Comma-separated presets to leave out."),
    min_seconds: float = typer.Option(3.0, "--min-seconds", help="Length of the final runs."),
    device: Optional[str] = typer.Option(None),
    out: Path = typer.Option(Path("best.yaml"), "--out", help="Where to write the winning Plan."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Pareto chart PNG (throughput vs p99, memory as colour)."),
    json_out: Optional[Path] = typer.Option(None, "--json"),
    db: Optional[Path] = typer.Option(None),
    fresh: bool = typer.Option(False, "--fresh", help="Ignore earlier measurements of the same tune in the store."),
) -> None:
    """Search the plan space for a goal under memory, latency and quality limits; write the best Plan."""
    import json

    from accelab.bench.options import default_scenario, validate
    from accelab.catalog.resolve import resolve
    from accelab.quality.verdict import LEVELS, rules_for
    from accelab.results.store import open_store
    from accelab.results.table import make_console
    from accelab.scenarios.workload import Workload
    from accelab.tune import report
    from accelab.tune.run import TuneSetup, parse_duration_s, parse_memory_mb, run_tune, winning_plan, write_plan
    from accelab.tune.search import Constraints
    from accelab.tune.space import search_space

    if goal not in ("throughput", "latency"):
        raise ValueError(f"--goal {goal!r} must be throughput or latency")
    if percentile not in ("p50", "p99"):
        raise ValueError(f"--percentile {percentile!r} must be p50 or p99")
    if quality not in (*LEVELS, "off"):
        raise ValueError(f"--quality {quality!r} must be one of strict, balanced, loose, off")
    constraints = Constraints(
        max_memory_mb=parse_memory_mb(max_memory) if max_memory else None, p99_ms=p99_ms, quality=quality  # type: ignore[arg-type]
    )
    budget_s = parse_duration_s(budget) if budget else None

    spec = resolve(model, task)
    chosen = default_scenario(spec.task) if scenario == "auto" else scenario
    generate = chosen == "generate"
    screen = batch_size or (1 if goal == "latency" else 4 if generate else 8)
    ladder_top = max_batch or (64 if generate else 256)
    if goal == "throughput":
        screen = min(screen, ladder_top)
    workload = Workload(scenario=chosen, batch_size=screen, seq_len=seq_len, new_tokens=new_tokens,  # type: ignore[arg-type]
                        image_size=image_size, min_seconds=min_seconds)
    validate(spec, workload)
    if quality != "off":
        rules_for(spec.task, quality)
    split = lambda text: [p.strip() for p in text.split(",") if p.strip()] if text else None  # noqa: E731
    space = search_space(spec, chosen, device, max_batch=ladder_top if goal == "throughput" else screen,
                         include=split(include), exclude=split(exclude),
                         # a slow technique cannot win on speed, but may fit a memory limit where fp32 does not
                         prune_slow=include is None and max_memory is None)
    if goal == "latency":
        space = type(space)(variants=space.variants, pruned=space.pruned, batch_sizes=[screen])
    setup = TuneSetup(
        spec=spec, workload=workload, space=space,
        goal="throughput" if goal == "throughput" else f"latency-{percentile}",  # type: ignore[arg-type]
        constraints=constraints, screen_batch=screen, tolerance=quality if quality != "off" else "balanced",
        budget_s=budget_s,
    )
    console = make_console()
    console.print(
        f"tuning {spec.name} ({chosen}) for {setup.goal}: {len(space.variants)} plans x batches "
        f"{space.batch_sizes[0]}..{space.batch_sizes[-1]}; limits: "
        f"memory {max_memory or '-'}, p99 {p99_ms or '-'} ms, quality {quality}"
    )
    store = open_store(db)
    log, measurer, group = run_tune(setup, store=store, device=device, fresh=fresh, console=console)
    unit = "tokens/s" if generate else "items/s"
    report.render(log, space.pruned, unit, console)
    if plot:
        report.plot_pareto(log, plot, unit, f"{spec.name} · {chosen} · tune {group}")
        console.print(f"Pareto chart: {plot}")
    if json_out:
        json_out.write_text(json.dumps({
            "tune_id": group, "winner": log.winner and log.winner.candidate.key,
            "runner_up": log.runner_up and log.runner_up.candidate.key, "tie": log.tie,
            "measured_seconds": log.measured_seconds, "reused": measurer.reused,
            "verdicts": log.verdicts, "pruned": space.pruned, "no_feasible_reason": log.no_feasible_reason,
            "run_ids": [r.run_id for r in measurer.results],
        }, indent=2))
    if log.winner is None:
        console.print(f"[bold red]{log.no_feasible_reason}[/]")
        raise typer.Exit(3)
    plan = winning_plan(log, group)
    assert plan is not None
    w = log.winner
    header = (
        f"accelab tune {spec.name} --goal {goal} ({setup.goal}), tune id {group}\n"
        f"winner {w.candidate.key}: {w.throughput:.4g} {unit}, p50 {w.p50_ms:.4g} ms, p99 {w.p99_ms:.4g} ms, "
        f"peak {w.memory_mb:.0f} MB, quality {w.quality or 'not checked'}\n"
        + (f"tie with {log.runner_up.candidate.key} (within noise)\n" if log.tie and log.runner_up else "")
        + f"reproduce: accelab bench {spec.name} --plan {out} --scenario {chosen}"
    )
    write_plan(plan, out, header)
    tie = f" (a tie with {log.runner_up.candidate.key}: within noise)" if log.tie and log.runner_up else ""
    console.print(f"[bold green]best plan: {w.candidate.key}{tie}[/] -> {out}")
    if log.budget_spent:
        console.print("[yellow]the --budget ran out: this is the best plan measured so far[/]")
