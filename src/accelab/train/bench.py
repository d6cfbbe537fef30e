"""`accelab train --bench`: what mixed precision, accumulation and data parallelism buy here.

Rows (each in its own worker process(es): accelerate's state is a process singleton):
baseline (fp32, one process), bf16 autocast, fp16 autocast (with GradScaler; "unsupported"
on CPU), gradient accumulation xA at the same global batch, N processes at the same global
batch (torchrun). Every row trains the same steps on the same data order; the rows share one
`group_id` in the results store.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accelab.launch import LaunchOptions
from accelab.measure.budget import PlanBudget
from accelab.results.result import Result, new_run_id
from accelab.train.accel import precision_problem
from accelab.train import launch as launcher
from accelab.train.config import TrainConfig
from accelab.train.report import result_of
from accelab.train.threads import threads_per_process


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchRow:
    name: str
    changes: dict[str, Any] = field(default_factory=dict)  # TrainConfig fields
    nproc: int = 1
    unsupported: str | None = None  # why it cannot run here (the row is reported, not run)


def bench_rows(config: TrainConfig, *, cuda: bool, bf16_on_gpu: bool | None, gpus: int, nproc: int,
               accum: int) -> list[BenchRow]:
    """The configurations to compare. Pure: the device facts are arguments."""
    rows = [BenchRow(name="baseline (fp32)")]
    for precision in ("bf16", "fp16"):
        rows.append(BenchRow(name=f"{precision} autocast", changes={"mixed_precision": precision},
                             unsupported=precision_problem(precision, cuda=cuda, bf16_on_gpu=bf16_on_gpu)))
    rows.append(BenchRow(name=f"grad accum x{accum}", changes={"grad_accum": accum},
                         unsupported=_split_problem(config.batch_size, 1, accum)))
    problem = _split_problem(config.batch_size, nproc, 1)
    if cuda and nproc > gpus:
        problem = f"{nproc} processes need {nproc} GPUs; {gpus} found"
    rows.append(BenchRow(name=f"{nproc} processes", nproc=nproc, unsupported=problem))
    return rows


def _techniques(row: BenchRow) -> list[str]:
    """The capability-report names of what a row changes (mixed precision is autocast)."""
    precision = row.changes.get("mixed_precision")
    return [f"{precision}-autocast"] if precision in ("bf16", "fp16") else []


def _split_problem(batch: int, nproc: int, accum: int) -> str | None:
    if batch % (nproc * accum):
        return f"global batch {batch} does not split into {nproc} process(es) x {accum} micro-steps"
    return None


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def run_bench(config: TrainConfig, spec: Any, rows: list[BenchRow], *, timeout_s: float, idle: float | None,
              tag: str | None = None, on_row: Any = None, budget: PlanBudget | None = None) -> list[Result]:
    """Run every supported row, one after another; a Result per row (shared group_id).
    idle: CPUs idle at launch (CPU runs), measured once so every row shares one thread policy.
    A row past its `budget` (see accelab.measure.budget; the baseline row is the yardstick) is
    stopped, and its Result says so."""
    from accelab.measure.environment import environment

    env = environment()
    group = new_run_id()
    budget = budget or PlanBudget()
    reference_s: float | None = None
    results = []
    for row in rows:
        used = _techniques(row)
        seconds = budget.seconds_for(used, reference_s)
        launch = LaunchOptions(nproc=row.nproc)
        row_config = config.with_changes(
            **row.changes, world_size=row.nproc, output_dir=str(Path(config.output_dir) / _slug(row.name)),
            result_path=None, checkpoints=False, save_final=False, save_as=None, progress=False, log_with="none",
            resume_from=None)
        if idle is not None:
            row_config = row_config.with_changes(threads=threads_per_process(row.nproc, config.threads, idle))
        outcome = None
        if row.unsupported is None:
            outcome = launcher.run(row_config, launch, timeout_s=min(timeout_s, seconds or timeout_s))
        result = result_of(name=row.name, spec=spec, config=row_config, launch=launch, outcome=outcome,
                           unsupported=row.unsupported, group_id=group, tag=tag, env=env)
        if result.status == "timeout" and seconds and seconds < timeout_s:
            result.status, result.reason = "stopped", budget.stopped_reason(seconds, used)
        if reference_s is None and result.ok and outcome is not None:
            reference_s = outcome.wall_s
        results.append(result)
        if on_row is not None:
            on_row(result)
    return results


def rows_json(results: list[Result]) -> list[dict[str, Any]]:
    """The table's rows as plain numbers (for --json and CI)."""
    out = []
    for r in results:
        m = r.metrics
        out.append({
            "configuration": r.plan["name"], "status": r.status, "reason": r.reason,
            "epoch_s": m.get("epoch_s"), "epoch_s_estimated": m.get("epoch_s_estimated"),
            "peak_rss_mb_max": m.get("peak_rss_mb_max"), "peak_rss_mb_sum": m.get("peak_rss_mb_sum"),
            "gpu_peak_allocated_mb_max": m.get("gpu_peak_allocated_mb_max"),
            "samples_per_s": m.get("samples_per_s"), "timed_samples": m.get("timed_samples"),
            "timed_wall_s": m.get("timed_wall_s"), "final_accuracy": m.get("final_accuracy"),
            "final_perplexity": m.get("final_perplexity"), "final_loss": m.get("final_loss"),
            "skipped_steps": m.get("skipped_steps"), "nproc": r.workload.get("nproc"),
            "grad_accum": r.workload.get("grad_accum"), "global_batch": r.workload.get("global_batch"),
        })
    return out
