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
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

from accelab.options import option

MixedPrecision = Literal["no", "bf16", "fp16"]
CompileMode = Literal["off", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
Schedule = Literal["linear", "cosine", "constant"]
TrainTask = Literal["image-classification", "text-generation"]
DatasetKind = Literal["digits", "imagefolder", "disk", "text"]
LogWith = Literal["none", "tensorboard"]
Sharding = Literal["ddp", "fsdp"]
# `train --bench` rows, in the order they run and print (baseline first: the reference)

TRAIN_TASKS: tuple[TrainTask, ...] = get_args(TrainTask)

BATCH_HELP = (
    "GLOBAL batch per optimizer step (all processes and accumulation micro-steps together); each process "
    "runs batch / (nproc x nnodes x grad-accum) samples per forward. Default 16 (images), 8 (text)."
)
THREADS_HELP = (
    "Intra-op threads per process. Default on CPU: the CPUs idle at "
    "launch / processes (a busy core stalls every OpenMP op: vit-tiny here ran "
    "4.8 samples/s with 2 threads on a half-busy 2-core machine, 120 with 1)."
)


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
    image_column: str | None = field(
        default=None, metadata=option("Image column of a saved dataset.", "--image-column", unset=True)
    )
    label_column: str | None = field(
        default=None, metadata=option("Label column of a saved dataset.", "--label-column", unset=True)
    )
    # None: the model's (config.image_size) or its processor's
    image_size: int | None = field(
        default=None, metadata=option("Training image side (default: the model's).", "--image-size", unset=True)
    )
    # causal LM: tokens per packed block
    block_size: int = field(
        default=128, metadata=option("Tokens per packed block (text). Default 128.", "--block-size", unset=True)
    )
    # held out when the dataset has no test split
    eval_fraction: float = field(
        default=0.2,
        metadata=option(
            "Held out for eval when the dataset has no test split. Default 0.2.", "--eval-fraction", unset=True
        ),
    )
    # replace a classifier head whose label count does not fit
    reinit_head: bool = field(
        default=False,
        metadata=option(
            "Replace a classifier head whose label count does not match the dataset (new random weights).",
            "--reinit-head",
        ),
    )

    # how long
    epochs: int = field(
        default=10,
        metadata=option(
            "Epochs. Default 10 for models with random weights (training from scratch), 3 for pretrained ones.",
            unset=True,
        ),
    )
    # train exactly this many optimizer steps (overrides epochs)
    max_steps: int | None = field(
        default=None, metadata=option("Train exactly this many optimizer steps.", "--max-steps", unset=True)
    )

    # optimisation
    # GLOBAL batch per optimizer step (see the module docstring)
    batch_size: int = field(default=16, metadata=option(BATCH_HELP, "--batch-size", "-b", unset=True))
    grad_accum: int = field(
        default=1, metadata=option("Accumulation micro-steps per optimizer step.", "--grad-accum", unset=True)
    )
    lr: float = field(
        default=4e-4,
        metadata=option(
            "Peak learning rate (AdamW). Default 4e-4 for models with random weights, 5e-5 for pretrained ones.",
            unset=True,
        ),
    )
    weight_decay: float = field(default=0.05, metadata=option(None, "--weight-decay", unset=True))
    schedule: Schedule = field(
        default="cosine", metadata=option("linear | cosine | constant, after the warm-up. Default cosine.", unset=True)
    )
    # None: warmup_ratio of the total steps
    warmup_steps: int | None = field(
        default=None, metadata=option("LR warm-up steps (default: --warmup-ratio).", "--warmup-steps", unset=True)
    )
    warmup_ratio: float = field(
        default=0.1, metadata=option("Warm-up share of all steps. Default 0.1.", "--warmup-ratio", unset=True)
    )
    # None or 0: no clipping
    max_grad_norm: float | None = field(
        default=1.0,
        metadata=option("Clip gradients to this norm; 0 = off. Default 1.0.", "--max-grad-norm", unset=True),
    )
    seed: int = field(
        default=0, metadata=option("Seed of the weights' init and the data order. Default 0.", unset=True)
    )

    # techniques
    mixed_precision: MixedPrecision = field(
        default="no",
        metadata=option("no | bf16 | fp16 (fp16 uses a GradScaler and needs a GPU).", "--mixed-precision", unset=True),
    )
    compile: CompileMode = field(
        default="off",
        metadata=option("torch.compile the model.", "--compile/--no-compile", unset=True, type=bool | None),
    )
    gradient_checkpointing: bool = field(
        default=False, metadata=option("Recompute activations in backward to save memory.", "--gradient-checkpointing")
    )
    attention: str | None = None  # attn_implementation, from a Plan
    # intra-op threads per process; None: torch's default (the CLI picks it, threads.py)
    threads: int | None = field(default=None, metadata=option(THREADS_HELP, unset=True))
    sharding: Sharding = field(
        default="ddp",
        metadata=option(
            "ddp (every rank holds all weights, gradients all-reduced) | fsdp (FSDP2: torch's fully_shard, "
            "parameters, gradients and optimizer state sharded over the ranks; gloo on CPU).",
            "--sharding",
            unset=True,
        ),
    )
    loader_workers: int = field(
        default=0,
        metadata=option(
            "DataLoader worker processes per rank (0: batches are made in the training process).",
            "--loader-workers",
            unset=True,
        ),
    )
    # train on CPU even where CUDA is present
    cpu: bool = field(default=False, metadata=option("Train on CPU even where CUDA is present (gloo).", "--cpu"))

    # processes
    world_size: int = 1  # nproc * nnodes, checked against what torchrun started

    # outputs
    output_dir: str
    # optimizer steps; checkpoints are also written at epoch ends
    checkpoint_every: int | None = field(
        default=None,
        metadata=option(
            "Save a checkpoint every N optimizer steps (and always at epoch ends).", "--checkpoint-every", unset=True
        ),
    )
    checkpoints: bool = True  # False: no checkpoints at all (bench rows)
    save_final: bool = True  # write the final model to <output_dir>/model (bench rows: no)
    resume_from: str | None = None  # a checkpoint directory (resolved from PATH | latest)
    eval_every: int | None = field(
        default=None,
        metadata=option(
            "Also evaluate every N optimizer steps (the eval curve that time-to-target reads).",
            "--eval-every",
            unset=True,
        ),
    )
    step_breakdown: bool = False  # time data / forward / backward / optimizer / communication (bench rows)
    log_with: LogWith = field(default="none", metadata=option("none | tensorboard.", "--log-with"))
    save_as: str | None = None  # store the trained model under this name (None: do not store)
    progress: bool = field(default=True, metadata=option(None, "--progress/--no-progress"))
    # optimizer steps left out of the throughput (first calls, compile)
    timing_warmup: int = field(
        default=2, metadata=option("Optimizer steps left out of samples/s. Default 2.", "--bench-warmup", unset=True)
    )
    turns_dir: str | None = None  # train --bench: take turns with the other rows (accelab.train.turns)
    turns_row: str | None = None  # ... as this row
    seconds_per_turn: float = 0.5  # ... for about this long (at least one optimizer step) per turn
    result_path: str | None = None  # rank 0 writes the run's summary here (JSON)

    def __post_init__(self) -> None:
        _check_choices(self)
        _check_ranges(self)
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


def _check_choices(config: TrainConfig) -> None:
    """ValueError when a field with a fixed set of values (a Literal) holds another."""
    _choice("task", config.task, TRAIN_TASKS, "; accelab trains image classifiers and causal LMs")
    _choice("dataset_kind", config.dataset_kind, get_args(DatasetKind))
    _choice("mixed_precision", config.mixed_precision, get_args(MixedPrecision), " (--mixed-precision)")
    _choice("compile", config.compile, get_args(CompileMode), " (--compile)")
    _choice("schedule", config.schedule, get_args(Schedule), " (--schedule)")
    _choice("log_with", config.log_with, get_args(LogWith), " (--log-with)")
    _choice("sharding", config.sharding, get_args(Sharding), " (--sharding)")


def _check_ranges(config: TrainConfig) -> None:
    """ValueError when a number is out of its range, naming the flag that sets it."""
    for name, flag in (
        ("epochs", "--epochs"),
        ("batch_size", "--batch-size"),
        ("grad_accum", "--grad-accum"),
        ("world_size", "--nproc"),
        ("block_size", "--block-size"),
    ):
        _at_least(name, getattr(config, name), 1, flag)
    _at_least("max_steps", config.max_steps, 1, "--max-steps")
    _at_least("checkpoint_every", config.checkpoint_every, 1, "--checkpoint-every")
    _at_least("eval_every", config.eval_every, 1, "--eval-every")
    _at_least("loader_workers", config.loader_workers, 0, "--loader-workers")
    _at_least("threads", config.threads, 1, "--threads")
    _at_least("warmup_steps", config.warmup_steps, 0, "--warmup-steps")
    _at_least("timing_warmup", config.timing_warmup, 0, "--bench-warmup")
    _at_least("image_size", config.image_size, 8, "--image-size")
    if not 0 <= config.warmup_ratio < 1:
        raise ValueError(f"warmup_ratio={config.warmup_ratio} must be within [0, 1); pass e.g. --warmup-ratio 0.1")
    if not 0 < config.eval_fraction < 1:
        raise ValueError(f"eval_fraction={config.eval_fraction} must be within (0, 1); pass e.g. --eval-fraction 0.2")
    if config.lr <= 0:
        raise ValueError(f"lr={config.lr} must be > 0; pass e.g. --lr 1e-3")
    if config.max_grad_norm is not None and config.max_grad_norm < 0:
        raise ValueError(
            f"max_grad_norm={config.max_grad_norm} must be > 0, or 0 to turn clipping off (--max-grad-norm)"
        )


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
