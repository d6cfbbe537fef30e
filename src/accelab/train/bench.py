"""`accelab train --bench`: what each training technique buys here.

Rows (each in its own worker process(es): accelerate's state is a process singleton), by their
--bench-rows key: baseline (fp32, one process), bf16 and fp16 autocast (fp16 "unsupported" on
CPU), accum (gradient accumulation xA at the same global batch), ddp (N processes at the same
global batch, torchrun), compile (torch.compile, default mode), checkpointing (activation
checkpointing, where the model's class supports it), workers (two DataLoader worker processes)
and fsdp (N processes, FSDP). Every row trains the same steps on the same data order; the rows
share one `group_id` in the results store. The rows run at once and take turns
(accelab.train.turns), so their speed-ups are paired rounds with an interval, as compare's are.

Each row also splits its steps into data / forward / backward / optimizer (and the gradient
communication where it happens: accelab.train.step_split) and reports its MFU against the peak
`accelab env` measured for its compute path (accelab.train.mfu).
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accelab.benchmark.contenders import turn_order
from accelab.launch import LaunchOptions
from accelab.measure import noise
from accelab.measure.budget import PlanBudget
from accelab.measure.environment import environment
from accelab.measure.hardware import PRECISION_PATHS, HardwareLimits, cached_limits
from accelab.measure.paired import check_overlap, paired_ratio
from accelab.measure.stats import summarize
from accelab.results import contract as K
from accelab.results.result import Result, new_run_id
from accelab.train import launch as launcher, turns
from accelab.train.accel import uses_cuda
from accelab.train.bench_rows import BenchRow, row_techniques
from accelab.train.config import TrainConfig
from accelab.train.mfu import row_peak, train_mfu
from accelab.train.report import result_of
from accelab.train.step_split import split_shares
from accelab.train.threads import threads_per_process


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


@dataclass(kw_only=True)
class _Running:
    """One bench row while the rows take turns."""

    row: BenchRow
    slug: str
    config: TrainConfig
    launch: LaunchOptions
    techniques: list[str]
    thread: threading.Thread | None = None
    outcome: Any = None  # accelab.launch.Outcome, once its launch ended
    own_s: float = 0.0  # the wall time of its turns
    stopped: str | None = None
    rounds: list[list[float]] = field(default_factory=list)  # step durations of each turn
    windows: list[noise.Window | None] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def rate(self, index: int) -> float:
        durations = self.rounds[index]
        return len(durations) * self.config.batch_size / sum(durations)

    def usable(self, index: int) -> bool:
        w = self.windows[index]
        return w is None or w.level != "unreliable"


def run_bench(
    config: TrainConfig,
    spec: Any,
    rows: list[BenchRow],
    *,
    timeout_s: float,
    idle: float | None,
    tag: str | None = None,
    on_row: Any = None,
    budget: PlanBudget | None = None,
    seconds_per_turn: float = 0.5,
    settle_s: float = 0.05,
) -> list[Result]:
    """Every supported row trains at once and they take turns (accelab.train.turns): one row's
    optimizer steps at a time, in alternating rounds, the machine's noise measured around each
    turn. A Result per row (shared group_id) with its rounds, its noise and, after the first row
    that ran, its paired speed-up over it. idle: CPUs idle at launch (CPU runs), measured once so
    every row shares one thread policy. A row past its `budget` (see accelab.measure.budget; the
    first row that finishes is the yardstick) is stopped, and its Result says so."""
    env = environment()
    group = new_run_id()
    budget = budget or PlanBudget()
    table = turns.Table(Path(config.output_dir) / "turns")
    running = [_start_row(row, config, idle, table, seconds_per_turn) for row in rows if row.unsupported is None]
    _launch_all(running, table, timeout_s=timeout_s, budget=budget, settle_s=settle_s)
    by_row = {r.row.name: r for r in running}
    reference = next((r for r in running if r.outcome is not None and r.outcome.status == "ok" and r.rounds), None)
    limits = cached_limits("cuda" if uses_cuda(config) else "cpu")  # measured by `accelab env` / the bench's caller
    results = []
    for row in rows:
        ran = by_row.get(row.name)
        result = result_of(
            name=row.name,
            spec=spec,
            config=ran.config if ran else _row_config(row, config, idle),
            launch=ran.launch if ran else LaunchOptions(nproc=row.nproc),
            outcome=ran.outcome if ran else None,
            unsupported=row.unsupported,
            group_id=group,
            tag=tag,
            env=env,
        )
        if ran is not None:
            _add_rounds(result, ran, reference)
            _add_mfu(result, limits, cuda=uses_cuda(config))
            _epoch_from_turns(result)
            if ran.stopped:
                result.status, result.reason = "stopped", ran.stopped
        results.append(result)
        if on_row is not None:
            on_row(result)
    return results


def _launch_all(
    running: list[_Running], table: turns.Table, *, timeout_s: float, budget: PlanBudget, settle_s: float
) -> None:
    """Each row's launch in a thread of its own, the rows taking turns until all are done; every
    row still running is stopped and every thread joined, whatever happens."""
    launch_timeout = timeout_s * max(1, len(running))  # a row also waits while the others take their turns
    for r in running:
        r.thread = threading.Thread(
            target=_launch, args=(r, launch_timeout), name=f"accelab-train-{r.slug}", daemon=True
        )
        r.thread.start()
    try:
        _take_turns(running, table, timeout_s=timeout_s, budget=budget, settle_s=settle_s)
    finally:
        for r in running:
            if r.alive:
                table.stop(r.slug)
            if r.thread is not None:
                r.thread.join()


def _row_config(row: BenchRow, config: TrainConfig, idle: float | None) -> TrainConfig:
    row_config = config.with_changes(
        **{"sharding": "ddp" if row.nproc == 1 else config.sharding, **row.changes},  # one process shards nothing
        world_size=row.nproc,
        output_dir=str(Path(config.output_dir) / _slug(row.name)),
        result_path=None,
        checkpoints=False,
        save_final=False,
        save_as=None,
        progress=False,
        log_with="none",
        resume_from=None,
        step_breakdown=True,
    )
    if idle is not None:
        row_config = row_config.with_changes(threads=threads_per_process(row.nproc, config.threads, idle))
    return row_config


def _start_row(
    row: BenchRow, config: TrainConfig, idle: float | None, table: turns.Table, seconds_per_turn: float
) -> _Running:
    slug = _slug(row.name)
    row_config = _row_config(row, config, idle).with_changes(
        turns_dir=str(table.dir), turns_row=slug, seconds_per_turn=seconds_per_turn
    )
    return _Running(
        row=row, slug=slug, config=row_config, launch=LaunchOptions(nproc=row.nproc), techniques=row_techniques(row)
    )


def _launch(r: _Running, timeout_s: float) -> None:
    r.outcome = launcher.run(r.config, r.launch, timeout_s=timeout_s)


def _settled(table: turns.Table, r: _Running) -> Callable[[], bool]:
    """Warm (ready for its first turn), finished, or gone."""
    return lambda: table.ready(r.slug) or table.finished(r.slug) or not r.alive


def _turn_over(table: turns.Table, r: _Running, index: int) -> Callable[[], bool]:
    """Its report of turn `index` is in, or it finished, or it is gone."""
    return lambda: table.report(r.slug, index) is not None or table.finished(r.slug) or not r.alive


def _take_turns(
    running: list[_Running], table: turns.Table, *, timeout_s: float, budget: PlanBudget, settle_s: float
) -> None:
    """Wait until every row is warm, then give turns in alternating rounds until all finished."""
    for r in running:
        table.wait_for(_settled(table, r), timeout_s=timeout_s)
    reference_s: float | None = None
    index = 0
    while True:
        active = [r for r in running if r.alive and table.ready(r.slug) and not table.finished(r.slug)]
        if not active:
            return
        for position in turn_order(len(running), index):
            r = running[position]
            if r not in active:
                continue
            limit = budget.seconds_for(r.techniques, reference_s)
            table.give(r.slug, index)
            started = time.monotonic()
            with noise.Meter([os.getpid()]) as meter:  # the rows are this process's descendants: all "own"
                done = table.wait_for(_turn_over(table, r, index), timeout_s=max(1.0, (limit or timeout_s) - r.own_s))
            r.own_s += time.monotonic() - started
            durations = table.report(r.slug, index)
            if durations:
                r.rounds.append(durations)
                r.windows.append(meter.window.with_cv(_cv(durations)) if meter.window is not None else None)
            if not done:
                r.stopped = (
                    budget.stopped_reason(limit, r.own_s, r.techniques)
                    if limit
                    else f"timeout: no turn finished within {timeout_s:.0f} s"
                )
                table.stop(r.slug)
            elif table.finished(r.slug) and r.thread is not None:
                # its final evaluation and exit run now, not inside the next rows' turns
                r.thread.join(timeout=timeout_s)
            time.sleep(settle_s)
        if reference_s is None:
            first = running[0]
            if table.finished(first.slug) or not first.alive:
                reference_s = first.own_s
        index += 1


def _epoch_from_turns(result: Result) -> None:
    """A row's epoch time from its timed steps (steps per epoch x batch / samples/s): its warm-up
    steps ran beside every other row's, before the turns began, so the epoch's own wall time
    would charge it for the others' start-up."""
    m = result.metrics
    steps, rate = m.get(K.STEPS_PER_EPOCH), m.get(K.SAMPLES_PER_S)
    if steps and rate:
        m[K.EPOCH_S], m[K.EPOCH_S_ESTIMATED] = steps * int(result.workload["global_batch"]) / rate, True


def _cv(durations: list[float]) -> float:
    return summarize(durations).cv if len(durations) > 1 else 0.0


def _add_rounds(result: Result, r: _Running, reference: _Running | None) -> None:
    """The row's turns, their noise and its paired speed-up over the reference row."""
    if not r.rounds:
        return
    windows = [w for w in r.windows if w is not None]
    result.metrics[K.NOISE] = noise.summary(windows, [r.usable(i) for i, w in enumerate(r.windows) if w is not None])
    result.metrics[K.ROUNDS] = [
        {
            "rate": r.rate(i),
            "seconds": sum(d),
            "calls": len(d),
            "used": r.usable(i),
            **({"steal": w.steal, "others_cores": w.others_cores, "level": w.level} if w else {}),
        }
        for i, (d, w) in enumerate(zip(r.rounds, r.windows))
    ]
    if reference is not None and reference is not r and result.ok:
        n = min(len(r.rounds), len(reference.rounds))
        ratio = paired_ratio(
            [r.rate(i) for i in range(n)],
            [reference.rate(i) for i in range(n)],
            [r.usable(i) and reference.usable(i) for i in range(n)],
        )
        ratio = check_overlap(
            ratio,
            [r.rate(i) for i in range(len(r.rounds)) if r.usable(i)],
            [reference.rate(i) for i in range(len(reference.rounds)) if reference.usable(i)],
        )
        result.metrics[K.SPEEDUP] = {**ratio.to_dict(), "reference": reference.row.name}


def _add_mfu(result: Result, limits: HardwareLimits | None, *, cuda: bool) -> None:
    """The row's MFU (accelab.train.mfu): its model FLOP/s over the measured peak of its compute
    path, scaled to the threads (CPU) or devices (GPU) it used."""
    split = result.metrics.get(K.STEP_SPLIT)
    if not result.ok or not split:
        return
    precision = result.plan["precision"]
    path, measured = limits.peak_for(precision) if limits else (PRECISION_PATHS.get(precision, "fp32"), None)
    peak = None
    if limits is not None and measured:
        threads = result.metrics.get(K.THREADS_PER_PROCESS) or limits.threads
        processes = result.workload["world_size"]
        peak = row_peak(measured, measured_threads=limits.threads, threads=threads, processes=processes, cuda=cuda)
        result.metrics[K.HARDWARE] = {
            "compute_path": path,
            "peak_flops": peak,
            "measured_flops": measured,
            "measured_threads": limits.threads,
        }
    result.metrics.update(
        train_mfu(
            forward_flops_per_sample=split.get("forward_flops_per_sample"),
            samples_per_s=result.metrics.get(K.SAMPLES_PER_S),
            peak_flops=peak,
            path=path,
        )
    )


def rows_json(results: list[Result]) -> list[dict[str, Any]]:
    """The table's rows as plain numbers (for --json and CI)."""
    out = []
    for r in results:
        m = r.metrics
        out.append(
            {
                "configuration": r.plan["name"],
                "status": r.status,
                "reason": r.reason,
                "epoch_s": m.get("epoch_s"),
                "epoch_s_estimated": m.get("epoch_s_estimated"),
                "peak_rss_mb_max": m.get("peak_rss_mb_max"),
                "peak_rss_mb_sum": m.get("peak_rss_mb_sum"),
                "gpu_peak_allocated_mb_max": m.get("gpu_peak_allocated_mb_max"),
                "samples_per_s": m.get("samples_per_s"),
                "timed_samples": m.get("timed_samples"),
                "timed_wall_s": m.get("timed_wall_s"),
                "final_accuracy": m.get("final_accuracy"),
                "final_perplexity": m.get("final_perplexity"),
                "final_loss": m.get("final_loss"),
                "skipped_steps": m.get("skipped_steps"),
                "mfu": m.get(K.MFU),
                "mfu_unknown": m.get(K.MFU_UNKNOWN),
                "step_split": split_shares(m.get(K.STEP_SPLIT)),
                "nproc": r.workload.get("nproc"),
                "grad_accum": r.workload.get("grad_accum"),
                "global_batch": r.workload.get("global_batch"),
            }
        )
    return out
