"""The train plan file: what `accelab train --tune` chose, as `accelab train --plan FILE` reads it.

    # accelab train plan, written by `accelab train --tune` ...
    kind: train-plan
    name: bf16 autocast + 2 processes (DDP)
    model: vit-tiny
    dataset: digits
    nproc: 2
    train: {mixed_precision: bf16, sharding: ddp, batch_size: 16, lr: 0.0004, ...}
    measured: {samples_per_s: ..., speedup: ..., time_to_target_s: ..., verdict: ...}

`train` holds TrainConfig fields only (checked on read: a typo fails with the known fields);
`measured` is for people. An inference Plan (`precision`, `compile`, ...) stays a valid --plan too.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from accelab.train.config import TrainConfig

KIND = "train-plan"
# the fields a train plan may set: the training techniques and hyper-parameters, not paths or bookkeeping
SETTABLE = (
    "mixed_precision",
    "compile",
    "gradient_checkpointing",
    "sharding",
    "loader_workers",
    "threads",
    "batch_size",
    "grad_accum",
    "lr",
    "weight_decay",
    "schedule",
    "warmup_ratio",
    "max_grad_norm",
    "attention",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainPlan:
    name: str
    train: dict[str, Any]
    nproc: int = 1
    model: str | None = None
    dataset: str | None = None
    measured: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        known = {f.name for f in fields(TrainConfig)}
        wrong = sorted(k for k in self.train if k not in SETTABLE)
        if wrong:
            where = "are not TrainConfig fields" if any(k not in known for k in wrong) else "are not plan settings"
            raise ValueError(f"train plan {self.name!r}: {', '.join(wrong)} {where}; a plan sets {', '.join(SETTABLE)}")
        if self.nproc < 1:
            raise ValueError(f"train plan {self.name!r}: nproc {self.nproc} must be 1 or more")

    def to_yaml(self, header: str = "") -> str:
        doc = {
            "kind": KIND,
            "name": self.name,
            "model": self.model,
            "dataset": self.dataset,
            "nproc": self.nproc,
            "train": dict(self.train),
            "measured": dict(self.measured),
        }
        comment = "".join(f"# {line}\n" for line in header.splitlines())
        return comment + yaml.safe_dump(doc, sort_keys=False)


def is_train_plan(ref: str | None) -> bool:
    """A YAML file whose `kind` is train-plan (inference Plans have no `kind`)."""
    if not ref or not ref.endswith((".yaml", ".yml")) or not Path(ref).is_file():
        return False
    doc = yaml.safe_load(Path(ref).read_text())
    return isinstance(doc, dict) and doc.get("kind") == KIND


def read(path: str | Path) -> TrainPlan:
    doc = yaml.safe_load(Path(path).read_text())
    if not isinstance(doc, dict) or doc.get("kind") != KIND:
        raise ValueError(f"{path} is not a train plan (kind: {KIND}); write one with `accelab train --tune --out FILE`")
    train = doc.get("train") or {}
    if not isinstance(train, dict):
        raise ValueError(f"{path}: `train` must be a mapping of TrainConfig fields")
    return TrainPlan(
        name=str(doc.get("name") or Path(path).stem),
        train=train,
        nproc=int(doc.get("nproc") or 1),
        model=doc.get("model"),
        dataset=doc.get("dataset"),
        measured=doc.get("measured") or {},
    )
