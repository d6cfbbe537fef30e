"""Start the ranks of a predict run and wait for them (`accelab.launch` starts, watches and
stops them).

One process on one node runs in this process (no launcher, no second model load). Several
(`--nproc`, `--nnodes`) run under torchrun; each node runs the same `accelab predict` command
with its `--node-rank`, and the output's directory must be on a filesystem every node sees (the
chunk files are the gather). The launch options are the training command's
(`accelab.launch.LaunchOptions`): the same flags, checked the same way.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from accelab.launch import LaunchOptions, Outcome, run_workers, worker_command
from accelab.predict.config import PredictConfig

WORKER_MODULE = "accelab.predict.worker"
KEPT = "the finished chunks are kept: rerun the same command to continue"


def run(config: PredictConfig, launch: LaunchOptions, *, work_dir: Path, threads: int | None) -> Outcome:
    """Run the ranks; the outcome carries global rank 0's summary."""
    if not launch.distributed:
        return _run_here(config)
    work_dir.mkdir(parents=True, exist_ok=True)
    summary_path = work_dir / f"summary-{os.getpid()}.json"
    config_path = work_dir / f"config-{os.getpid()}.json"
    summary_path.unlink(missing_ok=True)
    config_path.write_text(json.dumps(config.with_changes(summary_path=str(summary_path)).to_dict(), indent=2))
    try:
        return run_workers(
            worker_command(WORKER_MODULE, config_path, launch),
            summary_path=summary_path,
            threads=threads,
            timeout_s=config.timeout_s,
            what="predict",
            kept=KEPT,
        )
    finally:
        config_path.unlink(missing_ok=True)
        summary_path.unlink(missing_ok=True)


def _run_here(config: PredictConfig) -> Outcome:
    from accelab.predict.worker import run as run_rank

    start = time.perf_counter()
    summary = run_rank(config)  # ValueError / Unsupported propagate to the command
    return Outcome(
        status="ok", summary=summary, reason=None, wall_s=time.perf_counter() - start, command=None, returncode=None
    )


def threads_per_process(launch: LaunchOptions, threads: int | None, cpus: int) -> int | None:
    """Intra-op threads per rank: --threads, else the node's CPUs shared among its ranks
    (torchrun alone would pin every rank to 1 thread). None: torch's default (one process)."""
    if threads is not None:
        return threads
    if not launch.distributed:
        return None
    return max(1, cpus // launch.nproc)
