"""`accelab bench`: one model, one plan, one workload; rigorous numbers, stored."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from accelab.options import fields_of

PLAN_HELP = "A preset name (baseline, bf16-autocast, compile-static, int8-weight, ...) or a YAML plan file."
SET_HELP = "Override a plan field: --set batch_size=8 (repeatable)."
BATCH_HELP = "Inputs per call. Default: the plan's batch_size, else 1; the flag wins over the plan."
COMPARE_BATCH_HELP = (
    "Inputs per call for every plan that sets no batch_size; a plan's own wins "
    "(baseline[batch_size=16], a tuned plan file, --set batch_size=N)."
)


def register(app: typer.Typer) -> None:
    app.command("bench")(bench_command)
    app.command("compare")(compare_command)
    app.command("verify")(verify_command)


def bench_command(
    ctx: typer.Context,
    model: str = typer.Argument(
        ..., help="Catalog name, local directory, .gguf file, Hub id, or your own model as package.module:callable."
    ),
    task: str | None = typer.Option(None, help="Override the task inferred from the model's config."),
    plan: str = typer.Option("baseline", "--plan", help=PLAN_HELP),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    scenario: str = typer.Option("auto", help="forward | generate | auto (generate for generative models)."),
    batch_size: int | None = typer.Option(None, "--batch-size", "-b", help=BATCH_HELP),
    seq_len: int = typer.Option(128, "--seq-len", help="Text length of forward inputs, in tokens."),
    new_tokens: int = typer.Option(32, "--new-tokens", help="Tokens to generate per sequence."),
    image_size: int | None = typer.Option(
        None, "--image-size", help="Image side in pixels (default: the processor's)."
    ),
    inputs: str = typer.Option("real", help="real (the catalog's sample inputs) | synthetic (random, same shape)."),
    threads: int | None = typer.Option(None, help="Intra-op threads (sets the plan's threads field)."),
    device: str | None = typer.Option(None, help="cpu | cuda | cuda:N (default: CUDA when present)."),
    warmup: int = typer.Option(2, help="Untimed calls before measuring (the first call is always excluded)."),
    min_iters: int = typer.Option(5, "--min-iters", help="Measure at least this many calls..."),
    min_seconds: float = typer.Option(3.0, "--min-seconds", help="...and for at least this many seconds."),
    timeout: float = typer.Option(1800.0, help="Give up on the run after this many seconds."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the Result as JSON to this file."),
    db: Path | None = typer.Option(None, help="Results store (SQLite); default in the cache dir."),
    tag: str | None = typer.Option(None, help="Label this run, e.g. for `accelab regress`."),
    store: bool = typer.Option(True, "--store/--no-store", help="Append the run to the results store."),
) -> None:
    """Measure one model under one plan and workload: latency, throughput, memory, roofline."""
    from accelab.benchmark.engine import bench
    from accelab.benchmark.options import request_from
    from accelab.results.store import keep
    from accelab.results.table import print_bench

    request = request_from(ctx.params, plan=plan)
    _warn_if_busy()
    result = bench(request.spec, request.plan, request.workload, device=device, timeout_s=timeout, tag=tag)
    print_bench(result)
    keep(result, json_out=json_out, store=store, db=db)
    if result.status in ("error", "crashed", "timeout", "oom"):
        if result.metrics.get("traceback"):
            typer.echo(result.metrics["traceback"], err=True)
        raise typer.Exit(1)


def compare_command(
    ctx: typer.Context,
    model: str = typer.Argument(
        ..., help="Catalog name, local directory, .gguf file, Hub id, or your own model as package.module:callable."
    ),
    plans: str = typer.Option(
        "baseline,bf16-autocast,compile",
        "--plans",
        help="Comma-separated presets or YAML files; the first is the reference row.",
    ),
    task: str | None = typer.Option(None, help="Override the task inferred from the model's config."),
    set_: list[str] = typer.Option([], "--set", help="Override a field in every plan: --set batch_size=8."),
    scenario: str = typer.Option("auto", help="forward | generate | auto."),
    batch_size: int = typer.Option(1, "--batch-size", "-b", help=COMPARE_BATCH_HELP),
    seq_len: int = typer.Option(128, "--seq-len"),
    new_tokens: int = typer.Option(32, "--new-tokens"),
    image_size: int | None = typer.Option(None, "--image-size"),
    inputs: str = typer.Option("real", help="real | synthetic."),
    threads: int | None = typer.Option(None, help="Intra-op threads for every plan."),
    device: str | None = typer.Option(None, help="cpu | cuda | cuda:N."),
    warmup: int = typer.Option(2),
    min_iters: int = typer.Option(5, "--min-iters"),
    min_seconds: float = typer.Option(3.0, "--min-seconds"),
    quality: bool = typer.Option(
        True, "--quality/--no-quality", help="Verify every row against the fp32 eager reference."
    ),
    samples: int = typer.Option(8, help="Inputs compared by the quality guard."),
    tolerance: str = typer.Option(
        "balanced", help="strict | balanced | loose, optionally with metric=value overrides."
    ),
    timeout: float = typer.Option(1800.0, help="Per-plan time limit in seconds (a plan past it is an error)."),
    max_seconds_per_plan: float | None = typer.Option(
        None,
        "--max-seconds-per-plan",
        help="Stop a plan after this many seconds as too slow (its row says so). "
        "Default: only plans using a technique `accelab env` measured slower than fp32 here, after 3x the first "
        "plan's time (at least 60 s).",
    ),
    rounds: int = typer.Option(
        6,
        "--rounds",
        help="Turns per plan: the plans run in alternating short rounds "
        "(A B ... B A) and share --min-seconds / --min-iters among them.",
    ),
    sequential: bool = typer.Option(
        False,
        "--sequential",
        help="One plan at a time, each alone in memory (for "
        "models too big to hold several copies); speed-ups are then unpaired, and a "
        "busy minute can hit one plan only: the noise column says so.",
    ),
    json_out: Path | None = typer.Option(None, "--json", help="Write the rows and Results as JSON."),
    csv_out: Path | None = typer.Option(None, "--csv"),
    markdown_out: Path | None = typer.Option(None, "--markdown"),
    db: Path | None = typer.Option(None, help="Results store (SQLite)."),
    tag: str | None = typer.Option(None),
    store: bool = typer.Option(True, "--store/--no-store"),
) -> None:
    """Several plans side by side: latency, throughput, memory, speed-up and a quality verdict."""
    from accelab.benchmark.compare import quality_config_for, run_compare
    from accelab.benchmark.options import request_from, resolve_plan
    from accelab.benchmark.rounds import RoundsConfig
    from accelab.measure.budget import PlanBudget
    from accelab.measure.capabilities import slow_techniques
    from accelab.plan.apply import resolve_device
    from accelab.quality.verdict import rules_for
    from accelab.results import compare_table
    from accelab.results.store import open_store

    names = [p.strip() for p in plans.split(",") if p.strip()]
    if not names:
        raise ValueError("--plans is empty; give e.g. --plans baseline,compile")
    plan_objs = [resolve_plan(name, set_, threads) for name in names]
    # --batch-size is the rows' shared batch: run_compare lets a plan's own batch_size win
    request = request_from(ctx.params, plan=names[0])
    rules_for(request.spec.task, tolerance)  # a bad --tolerance fails now, not after the runs
    qconfig = quality_config_for(request.workload, samples, batch_size) if quality else None
    budget = PlanBudget(
        explicit_s=max_seconds_per_plan, slow=slow_techniques(resolve_device(plan_objs[0], device), measure=True)
    )
    _warn_if_busy()
    results = run_compare(
        request.spec,
        plan_objs,
        request.workload,
        device=device,
        quality=qconfig,
        tolerance=tolerance,
        timeout_s=timeout,
        tag=tag,
        budget=budget,
        rounds=RoundsConfig(**fields_of(RoundsConfig, ctx.params)),
    )
    wl = request.workload
    shape = f"batch {wl.batch_size}" + (f", {wl.new_tokens} new tokens" if wl.scenario == "generate" else "")
    compare_table.render(results, title=f"accelab compare · {request.spec.name} · {wl.scenario} · {shape}")
    if store:
        open_store(db).add(*results)
    if json_out:
        doc = {"rows": compare_table.rows(results), "results": [r.to_dict() for r in results]}
        json_out.write_text(json.dumps(doc, indent=2, default=str))
    if csv_out:
        csv_out.write_text(compare_table.to_csv(results))
    if markdown_out:
        markdown_out.write_text(compare_table.to_markdown(results))
    failed = [r.plan.get("name") for r in results if r.status in ("error", "crashed", "timeout", "oom")]
    if failed:  # "unsupported" is an answer; a run that broke is not
        typer.secho(
            f"{len(failed)} of {len(results)} plans did not run to the end: {', '.join(map(str, failed))} "
            "(the reasons are in the notes above)",
            fg=typer.colors.RED,
            err=True,
        )
        raise typer.Exit(1)


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
    samples: int = typer.Option(16, help="Number of real inputs (images, sentences, prompts) compared."),
    new_tokens: int = typer.Option(16, "--new-tokens", help="Greedy tokens per prompt (generation)."),
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
    from accelab.quality.collect import QualityConfig
    from accelab.quality.verdict import rules_for
    from accelab.quality.verify import verify
    from accelab.results.store import keep
    from accelab.results.table import print_verify

    plan_obj = resolve_plan(plan, set_, None)
    spec = resolve(model, task)
    rules_for(spec.task, tolerance)
    config = QualityConfig(samples=samples, new_tokens=new_tokens, batch_size=batch_size)
    result = verify(spec, plan_obj, config, tolerance=tolerance, device=device, timeout_s=timeout, tag=tag)
    print_verify(result)
    keep(result, json_out=json_out, store=store, db=db)
    if result.status in ("error", "crashed", "timeout", "oom") or (result.quality or {}).get("verdict") == "fail":
        raise typer.Exit(1)
