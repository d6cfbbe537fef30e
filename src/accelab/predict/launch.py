"""Start the ranks of a predict run and wait for them.

One process on one node runs in this process (no launcher, no second model load). Several
(`--nproc`, `--nnodes`) run under torchrun (`python -m torch.distributed.run`, the same
interpreter), the multi-node options passed through; each node runs the same `accelab predict`
command with its `--node-rank`, and the output's directory must be on a filesystem every node
sees (the chunk files are the gather). The launch options are the training command's
(`accelab.launch.LaunchOptions`): the same flags, checked the same way.

The parent blocks on torchrun (never spins), with a timeout. torchrun stays in this process
group, so Ctrl-C reaches it and it stops its ranks; it is also told to die with this process
(Linux PR_SET_PDEATHSIG), and each rank with torchrun, so a killed `accelab predict` leaves no
rank running that would write beside a resumed run.
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

from accelab.predict.config import PredictConfig
from accelab.launch import ELSEWHERE, LaunchOptions, torchrun_command, worker_env

log = logging.getLogger(__name__)

WORKER_MODULE = "accelab.predict.worker"
Status = Literal["ok", "error", "unsupported", "timeout", "crashed"]

__all__ = ["LaunchOptions", "Outcome", "run", "threads_per_process", "worker_command"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Outcome:
    status: Status
    summary: dict[str, Any] | None
    reason: str | None
    wall_s: float
    command: list[str] | None  # None: ran in this process


def worker_command(config_path: Path, launch: LaunchOptions) -> list[str]:
    return torchrun_command(launch, ["-m", WORKER_MODULE, str(config_path)])


def run(config: PredictConfig, launch: LaunchOptions, *, work_dir: Path, threads: int | None) -> Outcome:
    """Run the ranks; the outcome carries global rank 0's summary."""
    if not launch.distributed:
        return _run_here(config)
    work_dir.mkdir(parents=True, exist_ok=True)
    summary_path = work_dir / f"summary-{os.getpid()}.json"
    config_path = work_dir / f"config-{os.getpid()}.json"
    summary_path.unlink(missing_ok=True)
    config_path.write_text(json.dumps(config.with_changes(summary_path=str(summary_path)).to_dict(), indent=2))
    command = worker_command(config_path, launch)
    log.info("starting %s", " ".join(command))
    start = time.perf_counter()
    # preexec_fn runs between fork and exec: it only calls prctl, looked up beforehand (no import, no lock)
    proc = subprocess.Popen(command, env=worker_env(threads), preexec_fn=_die_with_parent())  # noqa: PLW1509
    try:
        returncode = proc.wait(timeout=config.timeout_s)  # blocks; no polling loop
    except subprocess.TimeoutExpired:
        return Outcome(status="timeout", summary=None, wall_s=time.perf_counter() - start, command=command,
                       reason=f"predict did not finish within {config.timeout_s:.0f} s; raise --timeout (the finished "
                              "chunks are kept: rerun the same command to continue)")
    finally:
        _stop(proc)
        config_path.unlink(missing_ok=True)
    outcome = _outcome(summary_path, returncode, command, time.perf_counter() - start)
    summary_path.unlink(missing_ok=True)
    return outcome


def _run_here(config: PredictConfig) -> Outcome:
    from accelab.predict.worker import run as run_rank

    start = time.perf_counter()
    summary = run_rank(config)  # ValueError / Unsupported propagate to the command
    return Outcome(status="ok", summary=summary, reason=None, wall_s=time.perf_counter() - start, command=None)


def _die_with_parent() -> Any:
    """A preexec_fn making the child (torchrun) get SIGTERM when this process dies, even by SIGKILL
    (Linux PR_SET_PDEATHSIG); torchrun then stops its ranks. None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 5)):  # torchrun forwards SIGTERM to its ranks
        try:
            proc.send_signal(sig)
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


def _outcome(summary_path: Path, returncode: int, command: list[str], wall: float) -> Outcome:
    doc = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    status = (doc or {}).get("status")
    if returncode == 0 and status == "ok":
        return Outcome(status="ok", summary=doc, reason=None, wall_s=wall, command=command)
    if returncode == 0 and doc is None:  # a node without global rank 0: the summary is written on that node
        return Outcome(status="ok", summary=None, reason=ELSEWHERE, wall_s=wall, command=command)
    if status in ("error", "unsupported"):
        return Outcome(status=status, summary=None, reason=doc.get("reason"), wall_s=wall, command=command)
    why = f"torchrun exited with code {returncode}" if returncode >= 0 else f"torchrun killed by signal {-returncode}"
    return Outcome(status="crashed", summary=None, wall_s=wall, command=command,
                   reason=f"{why} without a result; see the ranks' output above (finished chunks are kept: rerun "
                          "the same command to continue)")


def threads_per_process(launch: LaunchOptions, threads: int | None, cpus: int) -> int | None:
    """Intra-op threads per rank: --threads, else the node's CPUs shared among its ranks
    (torchrun alone would pin every rank to 1 thread). None: torch's default (one process)."""
    if threads is not None:
        return threads
    if not launch.distributed:
        return None
    return max(1, cpus // launch.nproc)
