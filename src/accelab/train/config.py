"""TrainConfig: one training run, fully resolved. Pure: no I/O, no torch.

The parent (`accelab train`) resolves the model, the dataset and the output directory, writes
this config as JSON and starts the worker processes (one, or `torchrun` for several); every
rank reads the same file, so all ranks agree on every choice.

Batch sizes. `batch_size` is the GLOBAL batch: the samples behind one optimizer step, summed
over all processes and accumulation micro-steps. Each process sees
`batch_size // (world_size * grad_accum)` samples per forward pass; the sum must divide evenly.

1 vs N processes (and vs accumulation) at the same global batch: every optimizer step sees the
same samples (one (seed, epoch) order, each loader batch split across ranks by accelerate), so
the per-step loss matches a one-process run within 1e-4 relative (tested on 2 gloo ranks); only
float summation order differs. Needs dropout off for exactness, and holds approximately for
models with BatchNorm (statistics over each rank's slice).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Final, Literal, get_args

from accelab.options import fields_of

MixedPrecision = Literal["no", "bf16", "fp16"]
CompileMode = Literal["off", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
Schedule = Literal["linear", "cosine", "constant"]
TrainTask = Literal["image-classification", "text-generation"]
DatasetKind = Literal["digits", "imagefolder", "disk", "text"]
LogWith = Literal["none", "tensorboard"]

TRAIN_TASKS: tuple[TrainTask, ...] = get_args(TrainTask)

# `accelab train`'s options and the TrainConfig fields they set (tests/test_command_options.py
# checks them against each other): an option named like a field sets it, but
OPTION_FIELDS: Final = {"compile_": "compile", "bench_warmup": "timing_warmup"}  # these, named apart
# set by build_request from what it resolves (the model, the dataset, the run directory, ...),
# never by an option of their own
DERIVED: Final = frozenset(
    {
        "task",
        "dataset",
        "dataset_kind",
        "model",
        "model_source",
        "world_size",
        "output_dir",
        "checkpoints",
        "save_final",
        "resume_from",
        "save_as",
        "attention",
        "turns_dir",
        "turns_row",
        "seconds_per_turn",
        "result_path",
    }
)


def explicit_fields(options: Mapping[str, Any]) -> dict[str, Any]:
    """The TrainConfig fields `accelab train`'s options (its parameters by name) give, None where
    not given (then the plan or the task's default decides); `compile` comes from --compile /
    --no-compile with --compile-mode."""
    explicit = fields_of(TrainConfig, options, renamed=OPTION_FIELDS, skip=DERIVED | {"compile"})
    flag = options["compile_"]
    explicit["compile"] = None if flag is None else (options["compile_mode"] if flag else "off")
    return explicit


def _choice(name: str, value: object, allowed: tuple, fix: str = "") -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not allowed; choose one of: {', '.join(map(str, allowed))}{fix}")


def _at_least(name: str, value: float | None, minimum: float, option: str) -> None:
    if value is not None and value < minimum:
        raise ValueError(f"{name}={value} is out of range: pass {option} {minimum} or more")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """Everything a worker needs. Paths are absolute; `model_source` is a local model directory."""

    # what to train
    model: str  # the name the user gave (catalog name, user model, directory)
    model_source: str
    task: TrainTask = "image-classification"
    dataset: str = "digits"  # "digits", a directory, a saved `datasets` dataset or a text file ("" = held-out text)
    dataset_kind: DatasetKind = "digits"
    image_column: str | None = None
    label_column: str | None = None
    image_size: int | None = None  # None: the model's (config.image_size) or its processor's
    block_size: int = 128  # causal LM: tokens per packed block
    eval_fraction: float = 0.2  # held out when the dataset has no test split
    reinit_head: bool = False  # replace a classifier head whose label count does not fit

    # how long
    epochs: int = 10
    max_steps: int | None = None  # train exactly this many optimizer steps (overrides epochs)

    # optimisation
    batch_size: int = 16  # GLOBAL batch per optimizer step (see the module docstring)
    grad_accum: int = 1
    lr: float = 4e-4
    weight_decay: float = 0.05
    schedule: Schedule = "cosine"
    warmup_steps: int | None = None  # None: warmup_ratio of the total steps
    warmup_ratio: float = 0.1
    max_grad_norm: float | None = 1.0  # None or 0: no clipping
    seed: int = 0

    # techniques
    mixed_precision: MixedPrecision = "no"
    compile: CompileMode = "off"
    gradient_checkpointing: bool = False
    attention: str | None = None  # attn_implementation, from a Plan
    threads: int | None = None  # intra-op threads per process; None: torch's default (the CLI picks it, threads.py)
    cpu: bool = False  # train on CPU even where CUDA is present

    # processes
    world_size: int = 1  # nproc * nnodes, checked against what torchrun started

    # outputs
    output_dir: str
    checkpoint_every: int | None = None  # optimizer steps; checkpoints are also written at epoch ends
    checkpoints: bool = True  # False: no checkpoints at all (bench rows)
    save_final: bool = True  # write the final model to <output_dir>/model (bench rows: no)
    resume_from: str | None = None  # a checkpoint directory (resolved from PATH | latest)
    log_with: LogWith = "none"
    save_as: str | None = None  # store the trained model under this name (None: do not store)
    progress: bool = True
    timing_warmup: int = 2  # optimizer steps left out of the throughput (first calls, compile)
    turns_dir: str | None = None  # train --bench: take turns with the other rows (accelab.train.turns)
    turns_row: str | None = None  # ... as this row
    seconds_per_turn: float = 0.5  # ... for about this long (at least one optimizer step) per turn
    result_path: str | None = None  # rank 0 writes the run's summary here (JSON)

    def __post_init__(self) -> None:
        _choice("task", self.task, TRAIN_TASKS, "; accelab trains image classifiers and causal LMs")
        _choice("dataset_kind", self.dataset_kind, get_args(DatasetKind))
        _choice("mixed_precision", self.mixed_precision, get_args(MixedPrecision), " (--mixed-precision)")
        _choice("compile", self.compile, get_args(CompileMode), " (--compile)")
        _choice("schedule", self.schedule, get_args(Schedule), " (--schedule)")
        _choice("log_with", self.log_with, get_args(LogWith), " (--log-with)")
        for name, option in (
            ("epochs", "--epochs"),
            ("batch_size", "--batch-size"),
            ("grad_accum", "--grad-accum"),
            ("world_size", "--nproc"),
            ("block_size", "--block-size"),
        ):
            _at_least(name, getattr(self, name), 1, option)
        _at_least("max_steps", self.max_steps, 1, "--max-steps")
        _at_least("checkpoint_every", self.checkpoint_every, 1, "--checkpoint-every")
        _at_least("threads", self.threads, 1, "--threads")
        _at_least("warmup_steps", self.warmup_steps, 0, "--warmup-steps")
        _at_least("timing_warmup", self.timing_warmup, 0, "--bench-warmup")
        _at_least("image_size", self.image_size, 8, "--image-size")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"warmup_ratio={self.warmup_ratio} must be within [0, 1); pass e.g. --warmup-ratio 0.1")
        if not 0 < self.eval_fraction < 1:
            raise ValueError(f"eval_fraction={self.eval_fraction} must be within (0, 1); pass e.g. --eval-fraction 0.2")
        if self.lr <= 0:
            raise ValueError(f"lr={self.lr} must be > 0; pass e.g. --lr 1e-3")
        if self.max_grad_norm is not None and self.max_grad_norm < 0:
            raise ValueError(
                f"max_grad_norm={self.max_grad_norm} must be > 0, or 0 to turn clipping off (--max-grad-norm)"
            )
        micro_batch(self.batch_size, self.world_size, self.grad_accum)

    @property
    def per_process_batch(self) -> int:
        return micro_batch(self.batch_size, self.world_size, self.grad_accum)

    @property
    def loader_batch(self) -> int:
        """Samples per dataloader batch before accelerate splits it over the processes
        (`split_batches=True`): the global batch of one accumulation micro-step."""
        return self.batch_size // self.grad_accum

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown TrainConfig field(s) {unknown}; fields are: {', '.join(sorted(known))}")
        return cls(**data)

    def with_changes(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)


def micro_batch(global_batch: int, world_size: int, grad_accum: int) -> int:
    """Per-process samples per forward pass; ValueError when the global batch does not split."""
    parts = world_size * grad_accum
    if global_batch % parts:
        lower = global_batch - global_batch % parts
        options = ", ".join(str(b) for b in (lower, lower + parts) if b > 0)
        raise ValueError(
            f"--batch-size {global_batch} is the global batch per optimizer step and must be divisible by "
            f"processes x grad-accum = {world_size} x {grad_accum} = {parts}; use --batch-size {options}, "
            "or change --nproc / --grad-accum"
        )
    return global_batch // parts


def warmup_for(config: TrainConfig, total_steps: int) -> int:
    """Warm-up steps of the LR schedule: --warmup-steps, else the ratio of the total steps."""
    if config.warmup_steps is not None:
        return min(config.warmup_steps, total_steps)
    return round(config.warmup_ratio * total_steps)


def total_steps(config: TrainConfig, steps_per_epoch: int) -> int:
    """Optimizer steps of the whole run: --max-steps when given (as many epochs as that takes),
    else epochs x steps per epoch."""
    return config.max_steps if config.max_steps is not None else config.epochs * steps_per_epoch


def epochs_needed(total: int, steps_per_epoch: int) -> int:
    return -(-total // steps_per_epoch)
