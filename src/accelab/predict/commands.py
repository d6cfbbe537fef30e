"""`accelab predict`: batch inference over a folder of images, a file of texts or a saved dataset."""

from __future__ import annotations

import tempfile
from pathlib import Path

import typer

PLAN_HELP = "A preset name (baseline, bf16-autocast, compile, int8-weight, ...) or a YAML plan file."


def register(app: typer.Typer) -> None:
    app.command("predict")(predict_command)


def predict_command(
    ctx: typer.Context,
    model: str = typer.Argument(..., help="Catalog name, user model, local directory, .gguf file or Hub id."),
    inputs: str = typer.Option(
        ...,
        "--inputs",
        "-i",
        help="A folder of images (searched recursively), a .jsonl/.csv/"
        ".tsv/.txt file of texts or prompts, or a `datasets` dataset saved with save_to_disk.",
    ),
    out: Path = typer.Option(
        ...,
        "--out",
        "-o",
        help="results.jsonl (any task), results.parquet (any task) or "
        "embeddings.npy (feature extraction; ids in embeddings.npy.ids.jsonl).",
    ),
    task: str | None = typer.Option(None, help="Override the task inferred from the model."),
    plan: str = typer.Option("baseline", "--plan", help=PLAN_HELP),
    set_: list[str] = typer.Option([], "--set", help="Override a plan field: --set precision=bf16-autocast."),
    text_field: str | None = typer.Option(
        None, "--text-field", help="Column with the text (default: text, prompt, sentence, or the only string column)."
    ),
    split: str | None = typer.Option(None, "--split", help="Split of a saved DatasetDict."),
    limit: int | None = typer.Option(None, "--limit", help="Only the first N inputs."),
    top_k: int = typer.Option(5, "--top-k", help="Labels per image (classification)."),
    max_length: int | None = typer.Option(
        None, "--max-length", help="Truncate texts to this many tokens (default: the model's limit)."
    ),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", help="Tokens to generate per input (greedy)."),
    prompt: str = typer.Option(
        "Describe the image.", "--prompt", help="The question asked about each image (vision-language models)."
    ),
    batch_size: int | None = typer.Option(
        None, "--batch-size", "-b", help="Per process (default: the plan's, else 32, or 8 for generation)."
    ),
    chunk_size: int | None = typer.Option(
        None,
        "--chunk-size",
        help="Items per resumable chunk (default 8 batches); an interrupted run redoes at most one chunk per process.",
    ),
    workers: int | None = typer.Option(
        None,
        "--workers",
        help="DataLoader workers per process for decoding and preprocessing (default: min(4, CPUs per process - 1)).",
    ),
    device: str = typer.Option("auto", help="auto | cpu | cuda | cuda:N (several processes: one GPU each)."),
    threads: int | None = typer.Option(None, help="Intra-op threads per process (default: CPUs / processes)."),
    nproc: int = typer.Option(
        1, "--nproc", help="Processes on this node (data parallel through torchrun when > 1; one per GPU)."
    ),
    nnodes: int = typer.Option(1, "--nnodes", help="Nodes; run the same command on each, output on a shared disk."),
    node_rank: int | None = typer.Option(None, "--node-rank"),
    master_addr: str | None = typer.Option(None, "--master-addr"),
    master_port: int | None = typer.Option(None, "--master-port"),
    rdzv_backend: str | None = typer.Option(
        None,
        "--rdzv-backend",
        help="torchrun rendezvous (c10d: every node runs the same command, no --node-rank needed).",
    ),
    rdzv_endpoint: str | None = typer.Option(None, "--rdzv-endpoint", help="HOST:PORT of the rendezvous."),
    rdzv_id: str | None = typer.Option(None, "--rdzv-id", help="The job's id, the same on every node."),
    rdzv_conf: str | None = typer.Option(None, "--rdzv-conf"),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="Replace an existing output, or discard an interrupted run's finished chunks instead of resuming.",
    ),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
    timeout: float = typer.Option(86400.0, help="Give up after this many seconds (finished chunks are kept)."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the Result as JSON to this file."),
    db: Path | None = typer.Option(None, help="Results store (SQLite); default in the cache dir."),
    tag: str | None = typer.Option(None, help="Label this run in the results store."),
    store: bool = typer.Option(True, "--store/--no-store", help="Append the run to the results store."),
) -> None:
    """Run a model over a whole dataset with a plan, in one process or many; resumable, ordered output."""
    from accelab.launch import refuse_outer_launcher

    refuse_outer_launcher("predict")

    from accelab.launch import LaunchOptions, outcome_elsewhere
    from accelab.plan.runtime import Unsupported
    from accelab.plan.techniques.system import available_cpus
    from accelab.predict import launch as launcher
    from accelab.predict.options import build_request, request_options
    from accelab.predict.report import print_run, result_of
    from accelab.results.store import keep

    launch = LaunchOptions.from_options(ctx.params)
    try:
        request = build_request(**request_options(ctx.params), launch=launch, cpus=available_cpus())
    except Unsupported as err:  # a plan technique that cannot run here: said before any model loads
        typer.secho(f"unsupported: {err}", fg=typer.colors.RED, err=True)
        raise typer.Exit(3) from None
    if request.resuming:
        typer.secho(f"resuming: {request.resuming:,} of {request.config.source_items:,} items are done", err=True)
    outcome = None
    try:
        with tempfile.TemporaryDirectory(prefix="accelab-predict-") as work_dir:
            outcome = launcher.run(request.config, launch, work_dir=Path(work_dir), threads=request.threads)
        result = result_of(request, outcome, tag=tag)
    except Unsupported as err:
        result = result_of(request, None, unsupported=str(err), tag=tag)
    if outcome_elsewhere(outcome):
        return
    print_run(result)
    keep(result, json_out=json_out, store=store, db=db)
    if not result.ok:
        raise typer.Exit(3 if result.status == "unsupported" else 1)
