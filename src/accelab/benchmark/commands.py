"""`accelab bench`: one model, one plan, one workload; rigorous numbers, stored."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from accelab.benchmark.config import COMPARE_OUTPUT, COMPARE_WORKLOAD, PLAN_HELP, SET_HELP, BenchRun, CompareRun
from accelab.options import Output, command, fields_of
from accelab.scenarios.workload import Workload

MODEL_HELP = "Catalog name, local directory, .gguf file, Hub id, or your own model as package.module:callable."
BROKE = ("error", "crashed", "timeout", "oom")  # "unsupported" is an answer; a run that broke is not


def register(app: typer.Typer) -> None:
    app.command("bench")(bench_command)
    app.command("compare")(compare_command)
    app.command("verify")(verify_command)


@command(BenchRun, Workload, Output)
def bench_command(model: str = typer.Argument(..., help=MODEL_HELP), **options: Any) -> None:
    """Measure one model under one plan and workload: latency, throughput, memory, roofline."""
    from accelab.benchmark.engine import bench
    from accelab.benchmark.options import request_from
    from accelab.results.store import keep
    from accelab.results.table import print_bench

    run = BenchRun(**fields_of(BenchRun, options))
    output = Output(**fields_of(Output, options))
    request = request_from({**options, "model": model}, plan=run.plan)
    _warn_if_busy()
    result = bench(
        request.spec, request.plan, request.workload, device=run.device, timeout_s=run.timeout, tag=output.tag
    )
    print_bench(result)
    keep(result, json_out=output.json_out, store=output.store, db=output.db)
    if result.status in BROKE:
        if result.metrics.get("traceback"):
            typer.echo(result.metrics["traceback"], err=True)
        raise typer.Exit(1)


@command(CompareRun, COMPARE_WORKLOAD, COMPARE_OUTPUT)
def compare_command(model: str = typer.Argument(..., help=MODEL_HELP), **options: Any) -> None:
    """Several plans side by side: latency, throughput, memory, speed-up and a quality verdict."""
    from accelab.benchmark.compare import quality_config_for, run_compare
    from accelab.benchmark.options import request_from, resolve_plan
    from accelab.benchmark.rounds import RoundsConfig
    from accelab.measure.budget import PlanBudget
    from accelab.measure.capabilities import slow_techniques
    from accelab.plan.apply import resolve_device
    from accelab.quality.verdict import rules_for

    run = CompareRun(**fields_of(CompareRun, options))
    output = Output(**fields_of(Output, options))
    plans = [resolve_plan(name, run.set_, run.threads) for name in run.plan_names]
    # --batch-size is the rows' shared batch: run_compare lets a plan's own batch_size win
    request = request_from({**options, "model": model}, plan=run.plan_names[0])
    plans = reference_that_fits(request.spec, plans, resolve_device(plans[0], run.device), say=typer.echo)
    rules_for(request.spec.task, run.tolerance)  # a bad --tolerance fails now, not after the runs
    quality = (
        quality_config_for(request.spec.task, request.workload, run.samples, options["batch_size"])
        if run.quality
        else None
    )
    slow = slow_techniques(resolve_device(plans[0], run.device), measure=True)
    _warn_if_busy()
    results = run_compare(
        request.spec,
        plans,
        request.workload,
        device=run.device,
        quality=quality,
        tolerance=run.tolerance,
        timeout_s=run.timeout,
        tag=output.tag,
        budget=PlanBudget(explicit_s=run.max_seconds_per_plan, slow=slow),
        rounds=RoundsConfig(**fields_of(RoundsConfig, options)),
    )
    wl = request.workload
    shape = f"batch {wl.batch_size}" + (f", {wl.new_tokens} new tokens" if wl.scenario == "generate" else "")
    _write_rows(results, run, output, title=f"accelab compare · {request.spec.name} · {wl.scenario} · {shape}")
    failed = [r.plan.get("name") for r in results if r.status in BROKE]
    if failed:
        typer.secho(
            f"{len(failed)} of {len(results)} plans did not run to the end: {', '.join(map(str, failed))} "
            "(the reasons are in the notes above)",
            fg=typer.colors.RED,
            err=True,
        )
        raise typer.Exit(1)


REFERENCE_FALLBACKS = ("bf16", "int8-weight", "int8-bf16")  # the widest precision first


def reference_that_fits(spec: Any, plans: list, device: Any, *, say: Callable[[str], None]) -> list:
    """The plans with the reference (the first, whose rounds the speed-ups divide) replaced by the
    widest precision that fits this machine's memory where it does not (an 8B's float32), said."""
    from accelab.plan import fit
    from accelab.plan.plan import load_plan
    from accelab.plan.runtime import Unsupported

    try:
        fit.check(spec, plans[0], device)
        return plans
    except Unsupported as why:
        for name in REFERENCE_FALLBACKS:
            wider = load_plan(name)
            try:
                fit.check(spec, wider, device)
            except Unsupported:
                continue
            if all(p.name != name for p in plans):
                say(f"reference: {name} in place of {plans[0].name}, the widest precision that fits: {why}")
                return [wider, *plans[1:]]
            say(f"reference: {name}, the widest precision that fits, in place of {plans[0].name}: {why}")
            return [wider, *[p for p in plans[1:] if p.name != name]]
        return plans  # nothing fits: each row says why


def _write_rows(results: list, run: CompareRun, output: Output, *, title: str) -> None:
    """The table on the terminal, the runs in the store, and the files asked for."""
    from accelab.results import compare_table
    from accelab.results.store import open_store

    compare_table.render(results, title=title)
    if output.store:
        open_store(output.db).add(*results)
    if output.json_out:
        doc = {"rows": compare_table.rows(results), "results": [r.to_dict() for r in results]}
        output.json_out.write_text(json.dumps(doc, indent=2, default=str))
    if run.csv_out:
        run.csv_out.write_text(compare_table.to_csv(results))
    if run.markdown_out:
        run.markdown_out.write_text(compare_table.to_markdown(results))


def _warn_if_busy() -> None:
    from accelab.measure.noise import warn_if_busy

    warn_if_busy(lambda text: typer.secho(f"warning: {text}", fg=typer.colors.YELLOW, err=True))


def verify_command(
    model: str = typer.Argument(
        ..., help="Catalog name, local directory, .gguf file, Hub id, or your own model as package.module:callable."
    ),
    plan: str = typer.Option(..., "--plan", help=PLAN_HELP),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    task: str | None = typer.Option(None),
    samples: int | None = typer.Option(
        None,
        help="Real inputs compared (images, sentences, prompts; generation also scores 2 text windows per "
        "sample). Default per task: 128 images, 32 sentences, 16 prompts.",
    ),
    new_tokens: int = typer.Option(
        16, "--new-tokens", help="Greedy tokens per prompt (generation; reported, not judged; 0 skips them)."
    ),
    batch_size: int = typer.Option(8, "--batch-size", "-b"),
    tolerance: str = typer.Option(
        "balanced", help="strict | balanced | loose, optionally with metric=value overrides."
    ),
    device: str | None = typer.Option(None),
    timeout: float = typer.Option(1800.0),
    json_out: Path | None = typer.Option(None, "--json"),
    db: Path | None = typer.Option(None),
    tag: str | None = typer.Option(None),
    store: bool = typer.Option(True, "--store/--no-store"),
) -> None:
    """Output fidelity of a plan against the fp32 eager reference on the same real inputs."""
    from accelab.benchmark.options import resolve_plan
    from accelab.catalog.resolve import resolve
    from accelab.quality.collect import config_for
    from accelab.quality.verdict import rules_for
    from accelab.quality.verify import verify
    from accelab.results.store import keep
    from accelab.results.table import print_verify

    plan_obj = resolve_plan(plan, set_, None)
    spec = resolve(model, task)
    rules_for(spec.task, tolerance)
    config = config_for(spec.task, samples, new_tokens=new_tokens, batch_size=batch_size)
    result = verify(spec, plan_obj, config, tolerance=tolerance, device=device, timeout_s=timeout, tag=tag)
    print_verify(result)
    keep(result, json_out=json_out, store=store, db=db)
    if result.status in BROKE or (result.quality or {}).get("verdict") == "fail":
        raise typer.Exit(1)  # "cannot tell" is an answer, not a failure: the table says what would tell
