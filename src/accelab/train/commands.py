"""`accelab train`: train / fine-tune a model with accelerate; `--bench` compares techniques.

    accelab train --model vit-tiny --dataset digits                  # -> model `digits-vit-tiny`
    accelab train --model vit-tiny --dataset ./photos --reinit-head  # class subfolders
    accelab train --model smollm2-135m --task text-generation --dataset notes.txt --block-size 256
    accelab train ... --mixed-precision bf16 --grad-accum 4 --max-grad-norm 1 --compile
    accelab train ... --nproc 2                                      # torchrun, gloo on CPU / NCCL on GPU
    accelab train ... --nproc 8 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --output-dir /shared/run
    accelab train ... --checkpoint-every 100 --log-with tensorboard
    accelab train ... --resume latest                                # or --resume PATH
    accelab train --bench --model vit-tiny --dataset digits --epochs 1 --json bench.json

The parent process checks everything it can (dataset, labels, batch split, precision, resume)
before it starts the worker(s) (`launch.py`), then prints and stores the Result(s).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from pathlib import Path
from typing import Any

import typer

from accelab.launch import LaunchOptions, outcome_elsewhere, refuse_outer_launcher
from accelab.options import Output, command, fields_of
from accelab.train.config import TrainConfig
from accelab.train.run_options import TrainRun, explicit_fields


def register(app: typer.Typer) -> None:
    app.command("train")(train_command)


@command(TrainRun, TrainConfig, LaunchOptions, Output)
def train_command(**options: Any) -> None:
    """Train an image classifier or fine-tune a causal LM with accelerate (mixed precision, accumulation,
    data parallel); store the model where bench, verify and serve find it."""
    from accelab.train.options import build_request

    refuse_outer_launcher("train")

    run = TrainRun(**fields_of(TrainRun, options))
    output = Output(**fields_of(Output, options))
    if run.bench or run.tune:  # fresh runs in a directory of their own, no model stored
        run = dataclasses.replace(run, output_dir=run.output_dir or _bench_dir(run.model), save=False)
    request = build_request(run, explicit=explicit_fields(options), launch=LaunchOptions.from_options(options))
    if run.bench:
        _bench(request, run, output)
    elif run.tune:
        from accelab.train.tune_command import tune_command

        tune_command(request, run, output, idle=_idle_cpus(request.config))
    else:
        _train(request, run.timeout, output)


def _bench_dir(model: str) -> Path:
    from accelab.paths import cache_dir

    name = Path(model.rstrip("/")).name or "model"
    return cache_dir() / "runs" / "bench" / f"{name}-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"


def _idle_cpus(config) -> float | None:
    """CPUs idle now, for the thread policy of CPU runs (threads.py); None on GPUs."""
    import torch

    from accelab.train.threads import idle_cpus

    return None if torch.cuda.is_available() and not config.cpu else idle_cpus()


def _with_threads(request, idle: float | None):
    from accelab.train.threads import affinity, note, threads_per_process

    if idle is None:
        return request
    threads = threads_per_process(request.launch.nproc, request.config.threads, idle)
    notes = (
        request.notes
        if request.config.threads
        else [*request.notes, note(request.launch.nproc, threads, idle, len(affinity()))]
    )
    return dataclasses.replace(request, config=request.config.with_changes(threads=threads), notes=notes)


def _train(request, timeout: float, output: Output) -> None:
    from accelab.results.store import keep
    from accelab.train import launch as launcher
    from accelab.train.report import print_run, result_of

    request = _with_threads(request, _idle_cpus(request.config))
    for note in request.notes:
        typer.secho(f"note: {note}", fg=typer.colors.YELLOW, err=True)
    outcome = launcher.run(request.config, request.launch, timeout_s=timeout)
    if outcome_elsewhere(outcome):
        return
    result = result_of(
        name="train",
        spec=request.spec,
        config=request.config,
        launch=request.launch,
        outcome=outcome,
        tag=output.tag,
        notes=request.notes,
    )
    if outcome.summary and outcome.summary.get("saved_model"):
        result.notes.append(f"model stored as {request.config.save_as} ({outcome.summary['saved_model']})")
    print_run(result)
    keep(result, json_out=output.json_out, store=output.store, db=output.db)
    if not result.ok:
        raise typer.Exit(3 if result.status == "unsupported" else 1)


def _bench(request, run: TrainRun, output: Output) -> None:
    import torch

    from accelab.measure.budget import PlanBudget
    from accelab.measure.capabilities import slow_techniques
    from accelab.measure.noise import warn_if_busy
    from accelab.train.bench import row_techniques, run_bench

    config = request.config
    cuda = torch.cuda.is_available() and not config.cpu
    rows = _bench_rows(config, run)
    device = torch.device("cuda" if cuda else "cpu")
    budget = PlanBudget(explicit_s=run.max_seconds_per_plan, slow=slow_techniques(device, measure=not cuda))
    warn_if_busy(lambda text: typer.secho(f"warning: {text}", fg=typer.colors.YELLOW, err=True))
    for row in rows:
        if row.unsupported is None and (line := budget.announcement(row_techniques(row), "the first row's")):
            typer.secho(f"bench row {row.name}: {line}", err=True)

    def say(result) -> None:
        typer.secho(f"bench row done: {result.plan['name']} ({result.status})", err=True)

    results = run_bench(
        config,
        request.spec,
        rows,
        timeout_s=run.timeout,
        idle=_idle_cpus(config),
        tag=output.tag,
        on_row=say,
        budget=budget,
    )
    _bench_report(request, results, output)


def _bench_rows(config, run: TrainRun) -> list:
    from accelab.train.bench_rows import bench_rows, device_facts

    return bench_rows(config, accum=run.bench_accum, only=run.bench_rows, **device_facts(config, run.bench_nproc))


def _bench_report(request, results: list, output: Output) -> None:
    from accelab.results.store import open_store
    from accelab.train.bench import rows_json
    from accelab.train.report import bench_table

    config = request.config
    steps = f"{config.max_steps} steps" if config.max_steps else f"{config.epochs} epoch(s)"
    bench_table(
        results,
        title=f"accelab train --bench · {request.spec.name} · {config.dataset or 'held-out text'} · "
        f"global batch {config.batch_size} · {steps}",
    )
    if output.store:
        open_store(output.db).add(*results)
    if output.json_out:
        doc = {"rows": rows_json(results), "results": [r.to_dict() for r in results]}
        output.json_out.write_text(json.dumps(doc, indent=2, default=str))
    if all(not r.ok for r in results):
        raise typer.Exit(1)
