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

import typer

BATCH_HELP = (
    "GLOBAL batch per optimizer step (all processes and accumulation micro-steps together); each process "
    "runs batch / (nproc x nnodes x grad-accum) samples per forward. Default 16 (images), 8 (text)."
)


def register(app: typer.Typer) -> None:
    app.command("train")(train_command)


def train_command(
    ctx: typer.Context,
    model: str = typer.Option("vit-tiny", "--model", "-m", help="Catalog name, user model or local model directory."),
    task: str | None = typer.Option(None, help="image-classification | text-generation (default: the model's)."),
    dataset: str | None = typer.Option(
        None,
        "--dataset",
        "-d",
        help="digits (built in), a directory of class "
        "subfolders, a `datasets` dataset saved to disk, or a text file (text-generation; "
        "default: the catalog's held-out essay).",
    ),
    image_column: str | None = typer.Option(None, "--image-column", help="Image column of a saved dataset."),
    label_column: str | None = typer.Option(None, "--label-column", help="Label column of a saved dataset."),
    image_size: int | None = typer.Option(None, "--image-size", help="Training image side (default: the model's)."),
    block_size: int | None = typer.Option(None, "--block-size", help="Tokens per packed block (text). Default 128."),
    eval_fraction: float | None = typer.Option(
        None, "--eval-fraction", help="Held out for eval when the dataset has no test split. Default 0.2."
    ),
    reinit_head: bool = typer.Option(
        False,
        "--reinit-head",
        help="Replace a classifier head whose label count does not match the dataset (new random weights).",
    ),
    epochs: int | None = typer.Option(
        None, help="Epochs. Default 10 for models with random weights (training from scratch), 3 for pretrained ones."
    ),
    max_steps: int | None = typer.Option(None, "--max-steps", help="Train exactly this many optimizer steps."),
    batch_size: int | None = typer.Option(None, "--batch-size", "-b", help=BATCH_HELP),
    grad_accum: int | None = typer.Option(None, "--grad-accum", help="Accumulation micro-steps per optimizer step."),
    lr: float | None = typer.Option(
        None, help="Peak learning rate (AdamW). Default 4e-4 for models with random weights, 5e-5 for pretrained ones."
    ),
    weight_decay: float | None = typer.Option(None, "--weight-decay"),
    schedule: str | None = typer.Option(None, help="linear | cosine | constant, after the warm-up. Default cosine."),
    warmup_steps: int | None = typer.Option(None, "--warmup-steps", help="LR warm-up steps (default: --warmup-ratio)."),
    warmup_ratio: float | None = typer.Option(None, "--warmup-ratio", help="Warm-up share of all steps. Default 0.1."),
    max_grad_norm: float | None = typer.Option(
        None, "--max-grad-norm", help="Clip gradients to this norm; 0 = off. Default 1.0."
    ),
    seed: int | None = typer.Option(None, help="Seed of the weights' init and the data order. Default 0."),
    mixed_precision: str | None = typer.Option(
        None, "--mixed-precision", help="no | bf16 | fp16 (fp16 uses a GradScaler and needs a GPU)."
    ),
    compile_: bool | None = typer.Option(None, "--compile/--no-compile", help="torch.compile the model."),
    compile_mode: str = typer.Option(
        "default", "--compile-mode", help="default | reduce-overhead | max-autotune | max-autotune-no-cudagraphs."
    ),
    gradient_checkpointing: bool = typer.Option(
        False, "--gradient-checkpointing", help="Recompute activations in backward to save memory."
    ),
    threads: int | None = typer.Option(
        None,
        help="Intra-op threads per process. Default on CPU: the CPUs idle at "
        "launch / processes (a busy core stalls every OpenMP op: vit-tiny here ran "
        "4.8 samples/s with 2 threads on a half-busy 2-core machine, 120 with 1).",
    ),
    cpu: bool = typer.Option(False, "--cpu", help="Train on CPU even where CUDA is present (gloo)."),
    plan: str | None = typer.Option(
        None,
        "--plan",
        help="A Plan (preset or YAML): precision *-autocast, compile, "
        "batch_size, threads, attention apply; explicit options win.",
    ),
    nproc: int = typer.Option(1, "--nproc", help="Processes on this node (data parallel; torchrun when > 1)."),
    nnodes: int = typer.Option(1, "--nnodes", help="Nodes (torchrun); run the same command on each."),
    node_rank: int | None = typer.Option(None, "--node-rank"),
    master_addr: str | None = typer.Option(None, "--master-addr"),
    master_port: int | None = typer.Option(None, "--master-port"),
    rdzv_backend: str | None = typer.Option(None, "--rdzv-backend"),
    rdzv_endpoint: str | None = typer.Option(None, "--rdzv-endpoint"),
    rdzv_id: str | None = typer.Option(None, "--rdzv-id"),
    rdzv_conf: str | None = typer.Option(None, "--rdzv-conf"),
    output_dir: Path | None = typer.Option(
        None,
        "--output-dir",
        "-o",
        help="Run directory (checkpoints, tensorboard, final model). Default: <cache>/runs/<name>/<time>.",
    ),
    checkpoint_every: int | None = typer.Option(
        None, "--checkpoint-every", help="Save a checkpoint every N optimizer steps (and always at epoch ends)."
    ),
    resume: str | None = typer.Option(None, "--resume", help="PATH to a checkpoint or run directory, or 'latest'."),
    log_with: str = typer.Option("none", "--log-with", help="none | tensorboard."),
    save_as: str | None = typer.Option(
        None,
        "--save-as",
        help="Store the trained model under this name (default <dataset>-<model>); bench, verify and serve find it.",
    ),
    save: bool = typer.Option(True, "--save/--no-save", help="Store the trained model."),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
    bench: bool = typer.Option(False, "--bench", help="Compare baseline, bf16, fp16, accumulation and N processes."),
    bench_nproc: int | None = typer.Option(
        None, "--bench-nproc", help="Processes of the data-parallel bench row (default 2, or the GPU count)."
    ),
    bench_accum: int = typer.Option(4, "--bench-accum", help="Micro-steps of the accumulation bench row."),
    max_seconds_per_plan: float | None = typer.Option(
        None,
        "--max-seconds-per-plan",
        help="--bench: stop a row after this many seconds as too slow (its row says "
        "so). Default: only rows using a technique `accelab env` measured slower than fp32 here, after 3x the "
        "baseline row's time (at least 60 s).",
    ),
    bench_warmup: int | None = typer.Option(
        None, "--bench-warmup", help="Optimizer steps left out of samples/s. Default 2."
    ),
    timeout: float = typer.Option(7200.0, help="Give up on a run (or bench row) after this many seconds."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the Result(s) as JSON to this file."),
    db: Path | None = typer.Option(None, help="Results store (SQLite); default in the cache dir."),
    tag: str | None = typer.Option(None, help="Label this run in the results store."),
    store: bool = typer.Option(True, "--store/--no-store", help="Append the run(s) to the results store."),
) -> None:
    """Train an image classifier or fine-tune a causal LM with accelerate (mixed precision, accumulation,
    data parallel); store the model where bench, verify and serve find it."""
    from accelab.launch import LaunchOptions, refuse_outer_launcher
    from accelab.train.config import explicit_fields
    from accelab.train.options import build_request

    refuse_outer_launcher("train")

    launch = LaunchOptions.from_options(ctx.params)
    explicit = explicit_fields(ctx.params)
    if bench:
        if resume:
            raise ValueError("--bench measures fresh runs; drop --resume")
        output_dir = output_dir or _bench_dir(model)
    request = build_request(
        model=model,
        task=task,
        dataset=dataset,
        explicit=explicit,
        plan=plan,
        launch=launch,
        output_dir=output_dir,
        resume=resume,
        save_as=save_as,
        save=save and not bench,
    )
    if bench:
        _bench(request, bench_nproc, bench_accum, timeout, json_out, db, tag, store, max_seconds_per_plan)
    else:
        _train(request, timeout, json_out, db, tag, store)


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


def _train(request, timeout: float, json_out: Path | None, db: Path | None, tag: str | None, store: bool) -> None:
    from accelab.launch import outcome_elsewhere
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
        tag=tag,
        notes=request.notes,
    )
    if outcome.summary and outcome.summary.get("saved_model"):
        result.notes.append(f"model stored as {request.config.save_as} ({outcome.summary['saved_model']})")
    print_run(result)
    keep(result, json_out=json_out, store=store, db=db)
    if not result.ok:
        raise typer.Exit(3 if result.status == "unsupported" else 1)


def _bench(
    request,
    bench_nproc: int | None,
    accum: int,
    timeout: float,
    json_out: Path | None,
    db: Path | None,
    tag: str | None,
    store: bool,
    max_seconds_per_plan: float | None,
) -> None:
    import torch

    from accelab.results.store import open_store
    from accelab.train.bench import bench_rows, row_techniques, rows_json, run_bench
    from accelab.train.report import bench_table

    config = request.config
    cuda = torch.cuda.is_available() and not config.cpu
    gpus = torch.cuda.device_count() if cuda else 0
    nproc = bench_nproc or max(gpus, 2)
    rows = bench_rows(
        config,
        cuda=cuda,
        bf16_on_gpu=torch.cuda.is_bf16_supported(including_emulation=False) if cuda else None,
        gpus=gpus,
        nproc=nproc,
        accum=accum,
    )

    def say(result) -> None:
        typer.secho(f"bench row done: {result.plan['name']} ({result.status})", err=True)

    from accelab.measure.budget import PlanBudget
    from accelab.measure.capabilities import slow_techniques
    from accelab.measure.noise import warn_if_busy

    device = torch.device("cuda" if cuda else "cpu")
    budget = PlanBudget(explicit_s=max_seconds_per_plan, slow=slow_techniques(device, measure=not cuda))
    warn_if_busy(lambda text: typer.secho(f"warning: {text}", fg=typer.colors.YELLOW, err=True))
    for row in rows:
        if row.unsupported is None and (line := budget.announcement(row_techniques(row), "the first row's")):
            typer.secho(f"bench row {row.name}: {line}", err=True)
    results = run_bench(
        config, request.spec, rows, timeout_s=timeout, idle=_idle_cpus(config), tag=tag, on_row=say, budget=budget
    )
    steps = f"{config.max_steps} steps" if config.max_steps else f"{config.epochs} epoch(s)"
    bench_table(
        results,
        title=f"accelab train --bench · {request.spec.name} · {config.dataset or 'held-out text'} · "
        f"global batch {config.batch_size} · {steps}",
    )
    if store:
        open_store(db).add(*results)
    if json_out:
        doc = {"rows": rows_json(results), "results": [r.to_dict() for r in results]}
        json_out.write_text(json.dumps(doc, indent=2, default=str))
    if all(not r.ok for r in results):
        raise typer.Exit(1)
