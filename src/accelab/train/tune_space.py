"""The training plans `accelab train --tune` considers, and how finalists are composed. Pure.

A candidate changes one thing from the baseline (the user's options): precision, compile, activation
checkpointing, loader workers, processes (DDP or FSDP) or the batch with its learning-rate rule. Each
belongs to an axis; the combined finalist takes, per axis, the fastest change that screened faster.

Learning-rate rule for a larger batch: AdamW's learning rate scales with the square root of the
batch (k x batch -> sqrt(k) x lr), the square-root rule for adaptive optimizers (Malladi et al.,
2022, "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms"); SGD's linear rule
overshoots with Adam. The convergence runs check the rule on the user's model rather than trust it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from accelab.train.accel import precision_problem
from accelab.train.bench import BenchRow
from accelab.train.config import TrainConfig

BASELINE = "baseline"


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """One plan: the TrainConfig fields it changes and its processes. `axis` groups the changes that
    exclude each other (two process layouts, two batch sizes)."""

    name: str
    axis: str
    key: str = BASELINE  # what --tune-plans calls it
    changes: dict[str, Any] = field(default_factory=dict)
    nproc: int = 1
    unsupported: str | None = None

    def row(self, **extra: Any) -> BenchRow:
        return BenchRow(
            name=self.name, changes={**self.changes, **extra}, nproc=self.nproc, unsupported=self.unsupported
        )


def candidates(
    config: TrainConfig,
    *,
    cuda: bool,
    bf16_on_gpu: bool | None,
    gpus: int,
    nproc: int,
    checkpointing: str | None = None,
) -> list[Candidate]:
    """The baseline and each single change that could run here (the others carry why not;
    `checkpointing`: why the model cannot checkpoint activations, None when it can)."""
    batch = config.batch_size
    out = [Candidate(name=BASELINE, axis=BASELINE)]
    if config.mixed_precision == "no":
        for precision in ("bf16", "fp16"):
            problem = precision_problem(precision, cuda=cuda, bf16_on_gpu=bf16_on_gpu)
            out.append(
                Candidate(
                    name=f"{precision} autocast",
                    axis="precision",
                    key=precision,
                    changes={"mixed_precision": precision},
                    unsupported=problem,
                )
            )
    if config.compile == "off":
        out.append(Candidate(name="compile", axis="compile", key="compile", changes={"compile": "default"}))
    if not config.gradient_checkpointing:
        out.append(
            Candidate(
                name="activation checkpointing",
                axis="checkpointing",
                key="checkpointing",
                changes={"gradient_checkpointing": True},
                unsupported=checkpointing,
            )
        )
    if config.loader_workers == 0:
        out.append(Candidate(name="loader workers x2", axis="workers", key="workers", changes={"loader_workers": 2}))
    out += _processes(config, cuda=cuda, gpus=gpus, nproc=nproc)
    out.append(
        Candidate(
            name=f"batch {2 * batch} (lr x1.41)",
            axis="batch",
            key="batch",
            changes={"batch_size": 2 * batch, "lr": config.lr * math.sqrt(2)},
        )
    )
    return out


def _processes(config: TrainConfig, *, cuda: bool, gpus: int, nproc: int) -> list[Candidate]:
    """`nproc` processes, DDP and FSDP, at the same global batch."""
    problem = f"{nproc} processes need {nproc} GPUs; {gpus} found" if cuda and nproc > gpus else None
    problem = problem or _split_problem(config.batch_size, nproc, config.grad_accum)
    return [
        Candidate(
            name=f"{nproc} processes ({sharding.upper()})",
            axis="processes",
            key=sharding,
            changes={"sharding": sharding},
            nproc=nproc,
            unsupported=problem,
        )
        for sharding in ("ddp", "fsdp")
    ]


KEYS = ("bf16", "fp16", "compile", "checkpointing", "workers", "ddp", "fsdp", "batch")


def only(space: list[Candidate], keys: str | None) -> list[Candidate]:
    """--tune-plans: the baseline and the named candidates. ValueError for a key that is not one."""
    if not keys:
        return space
    wanted = [k.strip() for k in keys.split(",") if k.strip()]
    unknown = [k for k in wanted if k not in KEYS]
    if unknown:
        raise ValueError(f"--tune-plans {keys!r}: {', '.join(unknown)} unknown; choose from {', '.join(KEYS)}")
    return [c for c in space if c.key == BASELINE or c.key in wanted]


def _split_problem(batch: int, nproc: int, accum: int) -> str | None:
    if batch % (nproc * accum):
        return f"global batch {batch} does not split into {nproc} processes x {accum} micro-steps"
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class Screened:
    """A candidate after screening: its paired speed-up over the baseline, or why it is out."""

    candidate: Candidate
    speedup: float | None
    verdict: str | None  # accelab.measure.paired's verdict of the speed-up
    out: str | None = None  # why it is not a finalist (unsupported, failed, over memory, slower)

    @property
    def faster(self) -> bool:
        return self.out is None and self.verdict == "faster"


def combine(chosen: list[Candidate]) -> Candidate:
    """One plan with every change of `chosen` (one per axis)."""
    changes: dict[str, Any] = {}
    for c in chosen:
        changes.update(c.changes)
    return Candidate(
        name=" + ".join(c.name for c in chosen),
        axis="combined",
        changes=changes,
        nproc=max(c.nproc for c in chosen),
    )


def finalists(screened: list[Screened], limit: int) -> list[Candidate]:
    """Up to `limit` plans to train to convergence (the baseline is trained besides them): the
    combination of the fastest faster change of each axis (when there are two or more), the
    faster single changes, fastest first, then the ones the screening could not tell from the
    baseline (no measurable difference, or rounds too noisy), by their measured ratio."""
    faster = sorted((s for s in screened if s.faster), key=lambda s: -(s.speedup or 0.0))
    undecided = sorted(
        (s for s in screened if s.out is None and not s.faster and s.candidate.name != BASELINE),
        key=lambda s: -(s.speedup or 0.0),
    )
    best_per_axis: dict[str, Candidate] = {}
    for s in faster:
        best_per_axis.setdefault(s.candidate.axis, s.candidate)
    out: list[Candidate] = []
    if len(best_per_axis) >= 2:
        out.append(combine(list(best_per_axis.values())))
    out += [s.candidate for s in faster + undecided]
    return out[:limit]
