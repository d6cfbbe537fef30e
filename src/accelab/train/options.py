"""From `accelab train` options (and an optional Plan) to a checked TrainConfig + LaunchOptions.

Every check that can fail without training runs here, in the parent, before any worker starts:
the dataset exists and its labels fit the model, the image size, the global batch splits over
processes and accumulation, the precision runs on this device, the resumed checkpoint fits.

Precedence: an explicit option, then the Plan's field (`--plan`), then the task's default.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accelab.catalog.spec import ModelSpec
from accelab.catalog.store import check_name
from accelab.launch import LaunchOptions
from accelab.paths import cache_dir
from accelab.plan.plan import load_plan
from accelab.train import checkpoint as ckpt, plan_file
from accelab.train.config import TRAIN_TASKS, TrainConfig, TrainTask
from accelab.train.data import class_names, detect_kind
from accelab.train.run_options import TrainRun

log = logging.getLogger(__name__)

# Plan precision -> accelerate mixed precision; weight casts and fp8 are inference plans
_PLAN_PRECISION = {"fp32": "no", "bf16-autocast": "bf16", "fp16-autocast": "fp16"}
_PLAN_FIELDS_USED = ("name", "precision", "compile", "batch_size", "threads", "attention")

# Per-task defaults for options left unset. Measured on the 2-core CPU with vit-tiny on digits
# (from random weights): lr 4e-4 at batch 16 reached 95.8-96.4 % test accuracy in 8 epochs
# (10 leave a margin); lr 1e-3 and above learned slower or not at all; batch 8 / lr 3e-4 was as
# good (97 % in 8 epochs).
DEFAULTS = {
    "image-classification": {"batch_size": 16, "weight_decay": 0.05},
    "text-generation": {"batch_size": 8, "weight_decay": 0.0},
}
FROM_SCRATCH = {"lr": 4e-4, "epochs": 10}  # models with random weights (catalog configs like vit-tiny)
FINE_TUNE = {"lr": 5e-5, "epochs": 3}  # pretrained weights


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainRequest:
    config: TrainConfig
    launch: LaunchOptions
    spec: ModelSpec
    notes: list[str] = field(default_factory=list)


def plan_settings(plan_ref: str | None) -> tuple[dict[str, Any], list[str]]:
    """The training options a Plan sets, and notes on the fields training does not use."""
    if plan_ref is None:
        return {}, []
    if plan_file.is_train_plan(plan_ref):  # written by `accelab train --tune`
        tuned = plan_file.read(plan_ref)
        return dict(tuned.train), [f"train plan {tuned.name!r} from {plan_ref}"]

    plan = load_plan(plan_ref)
    if plan.precision not in _PLAN_PRECISION:
        raise ValueError(
            f"plan {plan.name!r} has precision={plan.precision!r}, a cast of the weights for inference; training "
            "keeps fp32 weights under mixed precision: use a plan with fp32, bf16-autocast or fp16-autocast, "
            "or --mixed-precision"
        )
    settings: dict[str, Any] = {"mixed_precision": _PLAN_PRECISION[plan.precision], "compile": plan.compile}
    if plan.batch_size is not None:
        settings["batch_size"] = plan.batch_size
    if plan.threads is not None:
        settings["threads"] = plan.threads
    if plan.attention != "default":
        settings["attention"] = plan.attention
    ignored = [name for name in plan.differs_from_baseline() if name not in _PLAN_FIELDS_USED]
    notes = [f"plan fields {', '.join(ignored)} do not apply to training; ignored"] if ignored else []
    return settings, notes


def plan_launch(plan_ref: str | None, launch: LaunchOptions) -> LaunchOptions:
    """A train plan's processes, unless --nproc was given (anything but its default of 1)."""
    if launch.nproc != 1 or not plan_file.is_train_plan(plan_ref):
        return launch
    assert plan_ref is not None
    return dataclasses.replace(launch, nproc=plan_file.read(plan_ref).nproc)


def merge(explicit: dict[str, Any], plan: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """explicit (not None) > plan > defaults. Pure."""
    out = dict(defaults)
    out.update(plan)
    out.update({k: v for k, v in explicit.items() if v is not None})
    return out


def default_name(dataset: str, kind: str, model: str) -> str:
    """`digits-vit-tiny`, `flowers-resnet-50`, `smollm2-135m-heldout`: a valid store name."""
    model_tag = Path(model.rstrip("/")).name or "model"
    if kind == "text":
        stem = Path(dataset).stem if dataset not in ("", "heldout") else "heldout"
        name = f"{model_tag}-{stem}"
    else:
        stem = "digits" if kind == "digits" else Path(dataset.rstrip("/")).name
        name = f"{stem}-{model_tag}"
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-._")[:100]
    return name or "trained-model"


def run_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def build_request(run: TrainRun, *, explicit: dict[str, Any], launch: LaunchOptions) -> TrainRequest:
    """`explicit`: TrainConfig fields given on the command line (None where not given)."""
    from accelab.catalog.resolve import resolve

    plan_values, notes = plan_settings(run.plan)  # cheap checks first: a typo fails before any fetch
    launch = plan_launch(run.plan, launch)
    spec = resolve(run.model, run.task)
    task = _train_task(spec, run.model)
    dataset = run.dataset if run.dataset is not None else ("digits" if task == "image-classification" else "")
    kind = detect_kind(dataset, spec.task)
    dataset_path = (
        dataset if kind == "digits" or dataset in ("", "heldout") else str(Path(dataset).expanduser().resolve())
    )
    name = run.save_as or default_name(dataset, kind, run.model)
    if run.save:
        check_name(name)
    output_dir, checkpoint = _run_dir(run, cache_dir() / "runs" / name, launch)

    defaults = {**DEFAULTS[task], **(FROM_SCRATCH if spec.random_weights else FINE_TUNE)}
    config = TrainConfig(
        model=run.model,
        model_source=spec.source,
        task=task,
        dataset=dataset_path,
        dataset_kind=kind,
        world_size=launch.world_size,
        output_dir=str(output_dir.resolve()),
        resume_from=str(checkpoint) if checkpoint else None,
        save_as=name if run.save else None,
        **merge(explicit, plan_values, defaults),
    )
    notes += check(config, spec, launch)
    return TrainRequest(config=config, launch=launch, spec=spec, notes=notes)


def _train_task(spec: ModelSpec, model: str) -> TrainTask:
    if spec.custom:
        raise ValueError(
            f"{model} is a custom nn.Module; accelab train fine-tunes transformers checkpoints (it writes and resumes "
            "them with save_pretrained). Train it in your own loop, then measure and serve it with accelab bench, "
            "compare, tune, predict and serve"
        )
    task = next((t for t in TRAIN_TASKS if t == spec.task), None)
    if task is None:
        raise ValueError(
            f"{model} is a {spec.task} model; accelab trains image-classification and "
            "text-generation models (pass --task if the inferred task is wrong)"
        )
    return task


def _run_dir(run: TrainRun, runs_root: Path, launch: LaunchOptions) -> tuple[Path, Path | None]:
    """The run directory and the checkpoint to resume (None: a fresh run)."""
    output_dir = run.output_dir
    if launch.nnodes > 1 and output_dir is None:
        raise ValueError(
            "multi-node training needs --output-dir on a filesystem every node shares: checkpoints hold "
            "every rank's RNG state, and all nodes must write to the same run directory"
        )
    dirs = [output_dir] if output_dir else run_dirs(runs_root)
    checkpoint = ckpt.resolve_resume(run.resume, dirs) if run.resume else None
    if output_dir is None:
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        return (ckpt.run_dir_of(checkpoint) if checkpoint else runs_root / stamp), checkpoint
    if checkpoint is None and ckpt.complete_checkpoints(output_dir):
        raise ValueError(
            f"--output-dir {output_dir} already holds checkpoints of an earlier run; pass --resume latest "
            "to continue it, or choose another --output-dir"
        )
    return Path(output_dir), checkpoint


def check(config: TrainConfig, spec: ModelSpec, launch: LaunchOptions) -> list[str]:
    """The checks that read the model's config and the dataset's labels; returns warnings."""
    from accelab.train.accel import precision_problem
    from accelab.train.model import identity, image_size_for, label_fit, read_model_config, read_processor_config

    notes: list[str] = []
    _check_devices(config, launch)
    check_sharding(config, launch)
    model_config = read_model_config(config.model_source)
    classes = class_names(config)
    if classes is not None:
        fit = label_fit(model_config, classes, reinit_head=config.reinit_head, model=config.model)
        notes += [fit.note] if fit.note else []
        image_size_for(model_config, read_processor_config(config.model_source), config.image_size, config.model)
    if config.gradient_checkpointing:
        check_gradient_checkpointing(model_config, config.model)
    cuda = _cuda(config)
    problem = precision_problem(config.mixed_precision, cuda=cuda, bf16_on_gpu=_bf16(cuda))
    if problem:
        raise ValueError(problem)
    if config.resume_from:
        path = Path(config.resume_from)
        state = ckpt.read_state(path)
        notes += ckpt.check_compatible(
            state,
            path,
            identity=identity(model_config, config.task, len(classes) if classes else None),
            model=config.model,
            batch_size=config.batch_size,
            seed=config.seed,
            mixed_precision=config.mixed_precision,
        )
    return notes


def _cuda(config: TrainConfig) -> bool:
    import torch

    return torch.cuda.is_available() and not config.cpu


def _bf16(cuda: bool) -> bool | None:
    import torch

    return torch.cuda.is_bf16_supported(including_emulation=False) if cuda else None


def _check_devices(config: TrainConfig, launch: LaunchOptions) -> None:
    import torch

    if _cuda(config) and launch.nproc > torch.cuda.device_count():
        raise ValueError(
            f"--nproc {launch.nproc} needs {launch.nproc} GPUs on this node; {torch.cuda.device_count()} "
            "found. Use --nproc <= the GPU count, or --cpu for CPU processes (gloo)"
        )


def check_sharding(config: TrainConfig, launch: LaunchOptions) -> None:
    """What --sharding fsdp cannot run with (train/fsdp.py), and a checkpoint of the other kind."""
    from accelab.train.fsdp import checkpoint_problem

    problem = checkpoint_problem(Path(config.resume_from), config.sharding) if config.resume_from else None
    if config.sharding == "fsdp" and launch.world_size < 2:
        problem = "--sharding fsdp shards the model over processes, and there is 1: pass --nproc 2 or more"
    elif config.sharding == "fsdp" and config.compile != "off":
        problem = (
            "--compile with --sharding fsdp is not supported: accelab compiles through accelerate's prepare, "
            "which FSDP2 runs skip; drop --compile, or use --sharding ddp"
        )
    elif config.sharding == "fsdp" and config.mixed_precision == "fp16":
        problem = (
            "--mixed-precision fp16 with --sharding fsdp is not supported (accelab's FSDP path has no GradScaler for "
            "sharded gradients); use --mixed-precision bf16"
        )
    if problem:
        raise ValueError(problem)


def check_gradient_checkpointing(model_config: dict[str, Any], model: str) -> None:
    import transformers

    for arch in model_config.get("architectures") or []:
        cls = getattr(transformers, arch, None)
        if cls is not None and not getattr(cls, "supports_gradient_checkpointing", False):
            raise ValueError(
                f"{model} ({arch}) does not support gradient checkpointing in transformers; drop "
                "--gradient-checkpointing (or lower --batch-size / raise --grad-accum to save memory)"
            )
