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
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Final

from accelab.benchmark.options import spec_max_sequence_length
from accelab.catalog.spec import ModelSpec
from accelab.launch import LaunchOptions
from accelab.plan.plan import Plan, load_plan
from accelab.predict.chunks import rounded_chunk_size
from accelab.predict.config import (
    DEFAULT_BATCH,
    PredictConfig,
    default_chunk_size,
    default_workers,
    output_format,
)
from accelab.predict.launch import threads_per_process
from accelab.predict.parts import Parts, parts_path, sidecar_path
from accelab.predict.sources import ItemKind, open_source
from accelab.scenarios.workload import resolve_batch_size

log = logging.getLogger(__name__)

IMAGE_TASKS = ("image-classification", "image-text-to-text")
# `accelab predict`'s options: each passes to `build_request` as the parameter (or the
# PredictConfig field, through its **options) of its name, but for those named apart, and those
# build_request does not take: the launch's (LaunchOptions.from_options) and where the Result goes.
# tests/test_command_options.py checks them against each other.
OPTION_NAMES: Final = {"set_": "overrides", "timeout": "timeout_s"}
NOT_FOR_THE_REQUEST: Final = frozenset({f.name for f in fields(LaunchOptions)} | {"json_out", "db", "tag", "store"})


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


def request_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """`build_request`'s arguments from `accelab predict`'s options (its parameters by name),
    all but `launch` and `cpus`."""
    out = {OPTION_NAMES.get(k, k): v for k, v in options.items() if k not in NOT_FOR_THE_REQUEST}
    return {**out, "out": str(out["out"])}


def build_request(
    *,
    model: str,
    task: str | None,
    plan: str,
    overrides: list[str],
    inputs: str,
    out: str,
    launch: LaunchOptions,
    cpus: int,
    overwrite: bool = False,
    threads: int | None = None,
    device: str = "auto",
    batch_size: int | None = None,
    chunk_size: int | None = None,
    workers: int | None = None,
    **options: Any,
) -> PredictRequest:
    """`options`: text_field, split, limit, top_k, max_length, max_new_tokens, prompt, progress, timeout_s."""
    from accelab.catalog.resolve import resolve

    # cheap checks first: no model is fetched for a typo
    plan_obj = load_plan(plan, [*overrides, *([f"threads={threads}"] if threads is not None else [])])
    fmt = output_format(out)
    if fmt == "parquet" and importlib.util.find_spec("pyarrow") is None:
        raise ValueError(f"--out {out}: .parquet needs pyarrow (pip install pyarrow); or write .jsonl")
    spec = resolve(model, task)
    if fmt == "npy" and spec.task != "feature-extraction":
        raise ValueError(
            f"--out {out}: .npy holds embeddings, but {spec.name} is {spec.task}; write .jsonl or .parquet"
        )
    _check_max_length(spec, options.get("max_length"))
    want: ItemKind = "image" if spec.task in IMAGE_TASKS else "text"
    source = open_source(
        inputs,
        want=want,
        text_field=options.get("text_field"),
        split=options.get("split"),
        limit=options.get("limit"),
        taker=f"{spec.name} ({spec.task})",
    )

    # device, processes, techniques
    torch_device = _device(plan_obj, spec, device, launch)
    batch = resolve_batch_size(batch_size, plan_obj, DEFAULT_BATCH[spec.task])
    config = PredictConfig(
        spec=spec.to_dict(),
        plan=plan_obj.to_dict(),
        source=str(Path(inputs).resolve()),
        out=str(Path(out).resolve()),
        task=spec.task,
        source_items=len(source),
        source_digest=source.digest(),
        batch_size=batch,
        chunk_size=rounded_chunk_size(chunk_size or default_chunk_size(batch, len(source)), batch),
        workers=default_workers(cpus, launch.nproc) if workers is None else workers,
        device="cpu" if torch_device.type == "cpu" else device,
        world_size=launch.world_size,
        **{k: v for k, v in options.items() if v is not None},
    )
    resuming = _check_output(config, overwrite, primary=launch.node_rank in (None, 0))
    notes = list(source.notes)
    if resuming:
        notes.append(f"resuming an interrupted run: {resuming} of {len(source)} items are done")
    return PredictRequest(
        config=config,
        launch=launch,
        spec=spec,
        plan=plan_obj,
        source_format=source.format,
        threads=threads_per_process(launch, plan_obj.threads, cpus),
        resuming=resuming,
        notes=notes,
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
