"""`accelab bench`: one model, one plan, one workload; rigorous numbers, stored."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

PLAN_HELP = "A preset name (baseline, bf16-autocast, compile-static, int8-weight, ...) or a YAML plan file."
SET_HELP = "Override a plan field: --set batch_size=8 (repeatable)."


def register(app: typer.Typer) -> None:
    app.command("bench")(bench_command)


def bench_command(
    model: str = typer.Argument(..., help="Catalog name, local directory, .gguf file or Hub id."),
    task: Optional[str] = typer.Option(None, help="Override the task inferred from the model's config."),
    plan: str = typer.Option("baseline", "--plan", help=PLAN_HELP),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    scenario: str = typer.Option("auto", help="forward | generate | auto (generate for generative models)."),
    batch_size: int = typer.Option(1, "--batch-size", "-b"),
    seq_len: int = typer.Option(128, "--seq-len", help="Text length of forward inputs, in tokens."),
    new_tokens: int = typer.Option(32, "--new-tokens", help="Tokens to generate per sequence."),
    image_size: Optional[int] = typer.Option(None, "--image-size", help="Image side in pixels (default: the processor's)."),
    inputs: str = typer.Option("real", help="real (the catalog's sample inputs) | synthetic (random, same shape)."),
    threads: Optional[int] = typer.Option(None, help="Intra-op threads (sets the plan's threads field)."),
    device: Optional[str] = typer.Option(None, help="cpu | cuda | cuda:N (default: CUDA when present)."),
    warmup: int = typer.Option(2, help="Untimed calls before measuring (the first call is always excluded)."),
    min_iters: int = typer.Option(5, "--min-iters", help="Measure at least this many calls..."),
    min_seconds: float = typer.Option(3.0, "--min-seconds", help="...and for at least this many seconds."),
    timeout: float = typer.Option(1800.0, help="Give up on the run after this many seconds."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the Result as JSON to this file."),
    db: Optional[Path] = typer.Option(None, help="Results store (SQLite); default in the cache dir."),
    tag: Optional[str] = typer.Option(None, help="Label this run, e.g. for `accelab regress`."),
    store: bool = typer.Option(True, "--store/--no-store", help="Append the run to the results store."),
) -> None:
    """Measure one model under one plan and workload: latency, throughput, memory, roofline."""
    from accelab.bench.engine import bench
    from accelab.bench.options import build_request
    from accelab.results.store import open_store
    from accelab.results.table import print_bench

    request = build_request(
        model=model,
        task=task,
        plan=plan,
        overrides=set_,
        threads=threads,
        scenario=scenario,
        batch_size=batch_size,
        seq_len=seq_len,
        new_tokens=new_tokens,
        image_size=image_size,
        inputs=inputs,
        warmup=warmup,
        min_iters=min_iters,
        min_seconds=min_seconds,
    )
    result = bench(request.spec, request.plan, request.workload, device=device, timeout_s=timeout, tag=tag)
    print_bench(result)
    if json_out:
        json_out.write_text(result.to_json())
    if store:
        open_store(db).add(result)
    if result.status in ("error", "crashed", "timeout", "oom"):
        if result.metrics.get("traceback"):
            typer.echo(result.metrics["traceback"], err=True)
        raise typer.Exit(1)
