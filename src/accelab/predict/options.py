"""From `accelab predict` options to a checked PredictConfig + LaunchOptions, before any rank starts.

Every check that can fail without running the model is done here, in the parent: the plan, the
output format for the task, the source (exists, known format, not empty, the kind of input the
model takes), the device and the process count, the plan's techniques on this device, and
whether the output or an interrupted run's parts are in the way.
The batch size follows `resolve_batch_size`: --batch-size, then the plan's, then the task's default.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accelab.benchmark.options import spec_max_sequence_length
from accelab.catalog.spec import ModelSpec
from accelab.launch import LaunchOptions
from accelab.plan.plan import Plan, load_plan
from accelab.predict.chunks import rounded_chunk_size
from accelab.predict.config import (
    DEFAULT_BATCH,
    PredictConfig,
    PredictRun,
    default_chunk_size,
    default_workers,
    output_format,
)
from accelab.predict.launch import threads_per_process
from accelab.predict.parts import Parts, parts_path, sidecar_path
from accelab.predict.sources import open_source
from accelab.scenarios.workload import resolve_batch_size

log = logging.getLogger(__name__)

IMAGE_TASKS = ("image-classification", "image-text-to-text")


@dataclass(frozen=True, kw_only=True, slots=True)
class PredictRequest:
    config: PredictConfig
    launch: LaunchOptions
    spec: ModelSpec
    plan: Plan
    threads: int | None  # intra-op threads of each torchrun rank (None: torch's default)
    source_format: str
    resuming: int  # items already done by an interrupted run
    notes: list[str] = field(default_factory=list)


def build_request(
    model: str, run: PredictRun, *, given: Mapping[str, Any], launch: LaunchOptions, cpus: int
) -> PredictRequest:
    """`given`: the PredictConfig fields `accelab predict`'s options set (None where not given)."""
    from accelab.catalog.resolve import resolve

    # cheap checks first: no model is fetched for a typo
    threads = [f"threads={run.threads}"] if run.threads is not None else []
    plan = load_plan(run.plan, [*run.overrides, *threads])
    out = str(run.out)
    fmt = output_format(out)
    if fmt == "parquet" and importlib.util.find_spec("pyarrow") is None:
        raise ValueError(f"--out {out}: .parquet needs pyarrow (pip install pyarrow); or write .jsonl")
    spec = resolve(model, run.task)
    if fmt == "npy" and spec.task != "feature-extraction":
        raise ValueError(
            f"--out {out}: .npy holds embeddings, but {spec.name} is {spec.task}; write .jsonl or .parquet"
        )
    _check_max_length(spec, given.get("max_length"))
    source = open_source(
        run.inputs,
        want="image" if spec.task in IMAGE_TASKS else "text",
        text_field=given.get("text_field"),
        split=given.get("split"),
        limit=given.get("limit"),
        taker=f"{spec.name} ({spec.task})",
    )
    config = _config(spec, plan, source, run, given=given, launch=launch, cpus=cpus)
    resuming = _check_output(config, run.overwrite, primary=launch.node_rank in (None, 0))
    notes = list(source.notes)
    if resuming:
        notes.append(f"resuming an interrupted run: {resuming} of {len(source)} items are done")
    return PredictRequest(
        config=config,
        launch=launch,
        spec=spec,
        plan=plan,
        source_format=source.format,
        threads=threads_per_process(launch, plan.threads, cpus),
        resuming=resuming,
        notes=notes,
    )


def _config(
    spec: ModelSpec, plan: Plan, source: Any, run: PredictRun, *, given: Mapping[str, Any], launch, cpus: int
) -> PredictConfig:
    """The device, the processes, the batching; the options given, over PredictConfig's defaults."""
    requested = given["device"]
    torch_device = _device(plan, spec, requested, launch)
    batch = resolve_batch_size(given["batch_size"], plan, DEFAULT_BATCH[spec.task])
    chunk_size = given["chunk_size"] or default_chunk_size(batch, len(source))
    workers = given["workers"]
    resolved = {
        "batch_size": batch,
        "chunk_size": rounded_chunk_size(chunk_size, batch),
        "workers": default_workers(cpus, launch.nproc) if workers is None else workers,
        "device": "cpu" if torch_device.type == "cpu" else requested,
    }
    return PredictConfig(
        spec=spec.to_dict(),
        plan=plan.to_dict(),
        source=str(Path(run.inputs).resolve()),
        out=str(run.out.resolve()),
        task=spec.task,
        source_items=len(source),
        source_digest=source.digest(),
        world_size=launch.world_size,
        **{k: v for k, v in {**given, **resolved}.items() if v is not None},
    )


def _check_max_length(spec: ModelSpec, max_length: int | None) -> None:
    limit = spec_max_sequence_length(spec)
    if max_length is not None and limit is not None and max_length > limit:
        raise ValueError(
            f"--max-length {max_length} is more than {spec.name} takes ({limit} tokens); "
            f"pass --max-length {limit} or less"
        )


def _device(plan: Plan, spec: ModelSpec, requested: str, launch: LaunchOptions) -> Any:
    import torch

    from accelab.plan.apply import resolve_device
    from accelab.runtimes import check_supported

    device = resolve_device(plan, requested)
    if device.type == "cuda" and launch.nproc > torch.cuda.device_count():
        raise ValueError(
            f"--nproc {launch.nproc} but this node has {torch.cuda.device_count()} GPU(s): one process "
            f"per GPU; pass --nproc {torch.cuda.device_count()} or less, or --device cpu"
        )
    if launch.distributed and device.type == "cuda" and device.index not in (None, 0):
        raise ValueError(
            f"--device {requested} with several processes: each rank takes the GPU of its local rank; "
            "pass --device cuda (limit GPUs with CUDA_VISIBLE_DEVICES)"
        )
    check_supported(plan, spec, device)  # raises Unsupported with the reason
    return device


def _check_output(config: PredictConfig, overwrite: bool, *, primary: bool) -> int:
    """Items an interrupted run already did (0 for a fresh run); clears old files on --overwrite.
    Only the first node looks: the others share its output directory, which it may be writing."""
    out, parts = Path(config.out), Parts(config.out)
    if not primary:
        return 0
    if overwrite:
        for path in (out, sidecar_path(out, "skipped"), sidecar_path(out, "ids")):
            path.unlink(missing_ok=True)
        shutil.rmtree(parts_path(out), ignore_errors=True)
        return 0
    if not parts.exists():
        if out.exists():
            raise ValueError(f"--out {out} exists (a finished run); pass --overwrite to replace it, or another --out")
        out.parent.mkdir(parents=True, exist_ok=True)
        return 0
    parts.check_compatible(config.identity())
    return len(parts.done_indices())
