"""The rows of `accelab train --bench`, by their --bench-rows key (config.BENCH_ROW_KEYS): what
each changes from the baseline, and why it cannot run here when it cannot. Pure but for
`checkpointing_problem`, which reads the model's config: the device and model facts are arguments.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from accelab.launch import LaunchOptions
from accelab.train.accel import precision_problem
from accelab.train.config import TrainConfig
from accelab.train.model import read_model_config
from accelab.train.options import check_gradient_checkpointing, check_sharding
from accelab.train.run_options import BenchRowKey, bench_row_keys


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchRow:
    name: str
    changes: dict[str, Any] = field(default_factory=dict)  # TrainConfig fields
    nproc: int = 1
    unsupported: str | None = None  # why it cannot run here (the row is reported, not run)
    key: str = ""  # its --bench-rows key (config.BENCH_ROW_KEYS); "" for rows built elsewhere (the tuner's)


@dataclass(frozen=True, kw_only=True, slots=True)
class RowFacts:
    """What decides whether a row can run here: the run, and the device facts (arguments: pure)."""

    config: TrainConfig
    cuda: bool
    bf16_on_gpu: bool | None
    gpus: int
    nproc: int
    accum: int
    checkpointing: str | None  # why the model cannot checkpoint activations (None: it can)


def _baseline(f: RowFacts) -> BenchRow:
    return BenchRow(key="baseline", name="baseline (fp32)")


def _precision(precision: str) -> Callable[[RowFacts], BenchRow]:
    def row(f: RowFacts) -> BenchRow:
        return BenchRow(
            key=precision,
            name=f"{precision} autocast",
            changes={"mixed_precision": precision},
            unsupported=precision_problem(precision, cuda=f.cuda, bf16_on_gpu=f.bf16_on_gpu),
        )

    return row


def _accum(f: RowFacts) -> BenchRow:
    problem = _split_problem(f.config.batch_size, 1, f.accum)
    return BenchRow(key="accum", name=f"grad accum x{f.accum}", changes={"grad_accum": f.accum}, unsupported=problem)


def _processes(sharding: str) -> Callable[[RowFacts], BenchRow]:
    def row(f: RowFacts) -> BenchRow:
        problem = _split_problem(f.config.batch_size, f.nproc, 1)
        if f.cuda and f.nproc > f.gpus:
            problem = f"{f.nproc} processes need {f.nproc} GPUs; {f.gpus} found"
        if sharding == "ddp":
            return BenchRow(key="ddp", name=f"{f.nproc} processes", nproc=f.nproc, unsupported=problem)
        return BenchRow(
            key="fsdp",
            name=f"fsdp ({f.nproc} processes)",
            changes={"sharding": "fsdp"},
            nproc=f.nproc,
            unsupported=problem or _fsdp_problem(f.config, f.nproc),
        )

    return row


def _fsdp_problem(config: TrainConfig, nproc: int) -> str | None:
    """What `--sharding fsdp` cannot run with (options.py's check, e.g. the run's --compile)."""
    try:
        check_sharding(config.with_changes(sharding="fsdp", world_size=nproc), LaunchOptions(nproc=nproc))
    except ValueError as e:
        return str(e)
    return None


def _compile(f: RowFacts) -> BenchRow:
    return BenchRow(key="compile", name="compile", changes={"compile": "default"})


def _checkpointing(f: RowFacts) -> BenchRow:
    return BenchRow(
        key="checkpointing",
        name="activation checkpointing",
        changes={"gradient_checkpointing": True},
        unsupported=f.checkpointing,
    )


def _workers(f: RowFacts) -> BenchRow:
    return BenchRow(key="workers", name="loader workers x2", changes={"loader_workers": 2})


ROWS: dict[BenchRowKey, Callable[[RowFacts], BenchRow]] = {
    "baseline": _baseline,
    "bf16": _precision("bf16"),
    "fp16": _precision("fp16"),
    "accum": _accum,
    "ddp": _processes("ddp"),
    "compile": _compile,
    "checkpointing": _checkpointing,
    "workers": _workers,
    "fsdp": _processes("fsdp"),
}


def bench_rows(
    config: TrainConfig,
    *,
    cuda: bool,
    bf16_on_gpu: bool | None,
    gpus: int,
    nproc: int,
    accum: int,
    only: str | None = None,
    checkpointing: str | None = None,
) -> list[BenchRow]:
    """The configurations to compare: those `only` names (--bench-rows; None: all), the baseline
    first. Pure: the device and model facts are arguments. A row that would run exactly as the
    baseline (the run already sets what it changes) is reported, not run."""
    facts = RowFacts(
        config=config,
        cuda=cuda,
        bf16_on_gpu=bf16_on_gpu,
        gpus=gpus,
        nproc=nproc,
        accum=accum,
        checkpointing=checkpointing,
    )
    rows = [ROWS[key](facts) for key in bench_row_keys(only)]
    return [rows[0], *(_unless_baseline(row, config) for row in rows[1:])]


def _unless_baseline(row: BenchRow, config: TrainConfig) -> BenchRow:
    if row.unsupported is None and row.nproc == 1 and all(getattr(config, k) == v for k, v in row.changes.items()):
        shown = ", ".join(f"{k}={v}" for k, v in row.changes.items())
        return dataclasses.replace(row, unsupported=f"the baseline already runs with {shown}: nothing to compare")
    return row


def device_facts(config: TrainConfig, nproc: int | None = None) -> dict[str, Any]:
    """This machine, as `bench_rows` and the tuner's `candidates` take it: CUDA (unless the run is
    --cpu), its GPUs and their bf16 support, the processes of a multi-process row (`nproc`, else one
    per GPU and at least 2) and why the model cannot checkpoint activations (None: it can)."""
    cuda = torch.cuda.is_available() and not config.cpu
    gpus = torch.cuda.device_count() if cuda else 0
    return {
        "cuda": cuda,
        "bf16_on_gpu": torch.cuda.is_bf16_supported(including_emulation=False) if cuda else None,
        "gpus": gpus,
        "nproc": nproc or max(gpus, 2),
        "checkpointing": checkpointing_problem(config),
    }


def checkpointing_problem(config: TrainConfig) -> str | None:
    """Why the model cannot checkpoint activations (transformers' own flag), or None. Reads its config."""
    try:
        # options.py's check, the one `accelab train --gradient-checkpointing` runs
        check_gradient_checkpointing(read_model_config(config.model_source), config.model)
    except ValueError as e:
        return str(e).split(";")[0]  # the reason, without the fix for the --gradient-checkpointing flag
    return None


def row_techniques(row: BenchRow) -> list[str]:
    """The capability-report names of what a row changes (mixed precision is autocast)."""
    precision = row.changes.get("mixed_precision")
    used = [f"{precision}-autocast"] if precision in ("bf16", "fp16") else []
    return used + (["compile"] if row.changes.get("compile", "off") != "off" else [])


def _split_problem(batch: int, nproc: int, accum: int) -> str | None:
    if batch % (nproc * accum):
        return f"global batch {batch} does not split into {nproc} process(es) x {accum} micro-steps"
    return None
