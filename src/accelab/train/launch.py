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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from accelab.train.config import TrainConfig

log = logging.getLogger(__name__)

WORKER_MODULE = "accelab.train.worker"
Status = Literal["ok", "error", "unsupported", "timeout", "crashed"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchOptions:
    nproc: int = 1  # processes on this node
    nnodes: int = 1
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_backend: str | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    rdzv_conf: str | None = None

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ValueError(f"--nproc {self.nproc} must be 1 or more")
        if self.nnodes < 1:
            raise ValueError(f"--nnodes {self.nnodes} must be 1 or more")
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} must be within 0..{self.nnodes - 1} (--nnodes {self.nnodes})")
        if self.nnodes > 1 and not (self.master_addr or self.rdzv_endpoint):
            raise ValueError(f"--nnodes {self.nnodes} needs --master-addr HOST (and --node-rank on every node), "
                             "or --rdzv-endpoint HOST:PORT with --rdzv-backend c10d")

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def worker_command(config_path: Path, launch: LaunchOptions) -> list[str]:
    worker = ["-m", WORKER_MODULE, str(config_path)]
    if not launch.distributed:
        return [sys.executable, *worker]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(launch.nproc)]
    rendezvous = (launch.master_addr, launch.master_port, launch.rdzv_backend, launch.rdzv_endpoint)
    if launch.nnodes == 1 and not any(v is not None for v in rendezvous):
        cmd.append("--standalone")  # a free local port: concurrent runs on one machine do not collide
    else:
        cmd += ["--nnodes", str(launch.nnodes)]
        for flag, value in (("--node_rank", launch.node_rank), ("--master_addr", launch.master_addr),
                            ("--master_port", launch.master_port), ("--rdzv_backend", launch.rdzv_backend),
                            ("--rdzv_endpoint", launch.rdzv_endpoint), ("--rdzv_id", launch.rdzv_id),
                            ("--rdzv_conf", launch.rdzv_conf)):
            if value is not None:
                cmd += [flag, str(value)]
    return [*cmd, *worker]


def worker_env(threads: int | None) -> dict[str, str]:
    """The workers' environment. OMP_NUM_THREADS follows the run's threads (torchrun alone would
    pin every rank to 1 thread); the worker also calls torch.set_num_threads with them."""
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerOutcome:
    status: Status
    summary: dict[str, Any] | None
    reason: str | None
    returncode: int | None
    wall_s: float
    command: list[str]


def run_workers(config: TrainConfig, launch: LaunchOptions, *, timeout_s: float) -> WorkerOutcome:
    """Write the config, start the worker(s), wait; the outcome with rank 0's summary."""
    output = Path(config.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    result_path = Path(config.result_path or output / "train_result.json")
    result_path.unlink(missing_ok=True)
    config_path = output / "train_config.json"
    config_path.write_text(json.dumps(config.with_changes(result_path=str(result_path)).to_dict(), indent=2) + "\n")
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
        return WorkerOutcome(status="ok", summary=None, reason="the run's summary is written by global rank 0 (node 0)",
                             returncode=0, wall_s=wall, command=command)
    if status in ("error", "unsupported"):
        return WorkerOutcome(status=status, summary=None, reason=doc.get("reason"), returncode=returncode,
                             wall_s=wall, command=command)
    why = f"worker exited with code {returncode}" if returncode >= 0 else f"worker killed by signal {-returncode}"
    return WorkerOutcome(status="crashed", summary=None, reason=f"{why} without a result; see its output above",
                         returncode=returncode, wall_s=wall, command=command)
