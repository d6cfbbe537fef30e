"""Start the worker processes of one training run and wait for them.

One process: `python -m accelab.train.worker CONFIG.json`. Several (`--nproc`, `--nnodes`):
`torchrun` (`python -m torch.distributed.run`, the same interpreter) with the multi-node options
passed through; the ranks use gloo on CPUs (the worker's `Accelerator(cpu=True)`) and NCCL on
GPUs. Multi-node: run the same `accelab train ...` command on every node with its
`--node-rank`; checkpoints and the saved model are written by global rank 0, and resuming
needs the output directory on a filesystem every node sees.

The parent blocks on the child (never spins), with a timeout; the child runs in its own
session so that a timeout or Ctrl-C ends torchrun and all of its ranks.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from accelab.launch import ELSEWHERE, LaunchOptions, torchrun_command, worker_env
from accelab.train.config import TrainConfig

log = logging.getLogger(__name__)

WORKER_MODULE = "accelab.train.worker"
Status = Literal["ok", "error", "unsupported", "timeout", "crashed"]


def worker_command(config_path: Path, launch: LaunchOptions) -> list[str]:
    worker = ["-m", WORKER_MODULE, str(config_path)]
    if not launch.distributed:
        return [sys.executable, *worker]
    return torchrun_command(launch, worker)


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerOutcome:
    status: Status
    summary: dict[str, Any] | None
    reason: str | None
    returncode: int | None
    wall_s: float
    command: list[str]


def run_workers(config: TrainConfig, launch: LaunchOptions, *, timeout_s: float) -> WorkerOutcome:
    """Write the config, start the worker(s), wait; the outcome with rank 0's summary.

    The run directory keeps train_config.json (and rank 0 writes train_result.json beside it),
    but what the workers read and report goes through this process's own temporary files: on a
    disk shared by several nodes, each node's launcher then reads only its own ranks' report."""
    output = Path(config.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    _write_atomically(output / "train_config.json", config.to_dict())
    with tempfile.TemporaryDirectory(prefix="accelab-train-") as private:
        result_path = Path(config.result_path or Path(private) / "train_result.json")
        result_path.unlink(missing_ok=True)
        config_path = Path(private) / "train_config.json"
        config_path.write_text(json.dumps(config.with_changes(result_path=str(result_path)).to_dict(), indent=2))
        return _launch(config, launch, config_path, result_path, timeout_s=timeout_s)


def _write_atomically(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, path)


def _launch(config: TrainConfig, launch: LaunchOptions, config_path: Path, result_path: Path, *,
            timeout_s: float) -> WorkerOutcome:
    command = worker_command(config_path, launch)
    env = worker_env(config.threads)
    log.info("starting %s", " ".join(command))
    start = time.perf_counter()
    proc = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        returncode = proc.wait(timeout=timeout_s)  # blocks; no polling loop
    except subprocess.TimeoutExpired:
        return WorkerOutcome(status="timeout", summary=None, returncode=None, command=command,
                             reason=f"training did not finish within {timeout_s:.0f} s; raise --timeout",
                             wall_s=time.perf_counter() - start)
    finally:
        _stop(proc)
    return _outcome(result_path, returncode, command, time.perf_counter() - start)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)  # torchrun and every rank: they share the child's session
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _outcome(result_path: Path, returncode: int, command: list[str], wall: float) -> WorkerOutcome:
    doc = json.loads(result_path.read_text()) if result_path.is_file() else None
    status = (doc or {}).get("status")
    if returncode == 0 and status == "ok":
        return WorkerOutcome(status="ok", summary=doc, reason=None, returncode=0, wall_s=wall, command=command)
    if returncode == 0 and doc is None:  # a node without global rank 0: the summary is written on node 0
        return WorkerOutcome(status="ok", summary=None, reason=ELSEWHERE, returncode=0, wall_s=wall, command=command)
    if status in ("error", "unsupported"):
        return WorkerOutcome(status=status, summary=None, reason=doc.get("reason"), returncode=returncode,
                             wall_s=wall, command=command)
    why = f"worker exited with code {returncode}" if returncode >= 0 else f"worker killed by signal {-returncode}"
    return WorkerOutcome(status="crashed", summary=None, reason=f"{why} without a result; see its output above",
                         returncode=returncode, wall_s=wall, command=command)
