"""Worker processes shared by `accelab train` and `accelab predict`: the launch options, the
torchrun command line, the workers' environment, and how a worker ends (its exit codes and
the summary rank 0 leaves for the parent).

Several processes (`--nproc`, `--nnodes`) run under torchrun (`python -m torch.distributed.run`,
the same interpreter) with the multi-node options passed through; one node without rendezvous
options uses `--standalone`, a free local port, so concurrent runs on one machine do not collide.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

EXIT_USER_ERROR = 2
EXIT_UNSUPPORTED = 3


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


def torchrun_command(launch: LaunchOptions, worker: list[str]) -> list[str]:
    """torchrun running `python <worker...>` on launch.nproc ranks of this node."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(launch.nproc)]
    rendezvous = (launch.master_addr, launch.master_port, launch.rdzv_backend, launch.rdzv_endpoint)
    if launch.nnodes == 1 and all(v is None for v in rendezvous):
        cmd.append("--standalone")
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
    """The workers' environment: offline, quiet, and OMP_NUM_THREADS = the run's threads
    (torchrun alone would pin every rank to 1 thread; the worker also sets torch's)."""
    env = dict(os.environ)
    for key, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1"),
                       ("TOKENIZERS_PARALLELISM", "false")):
        env.setdefault(key, value)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def run_worker(job: Callable[[], dict[str, Any] | None], *, rank: int, world_size: int,
               write: Callable[[dict[str, Any]], None], unsupported: type[BaseException]) -> int:
    """Run one rank's job and return its exit code. Its summary (or, on rank 0, the failure:
    status, reason, traceback) goes to `write`; a user error or an unsupported setting ends it
    with a message and no traceback, anything else is re-raised after it is written."""

    def fail(status: str, reason: str, code: int, tb: str | None = None) -> int:
        prefix = f"[rank {rank}] " if world_size > 1 else ""
        print(f"{prefix}{status}: {reason}", file=sys.stderr)
        if rank == 0:
            write({"status": status, "reason": reason, "traceback": tb})
        return code

    try:
        summary = job()
    except unsupported as err:
        return fail("unsupported", str(err), EXIT_UNSUPPORTED)
    except ValueError as err:
        return fail("error", str(err), EXIT_USER_ERROR)
    except BaseException as err:
        fail("error", f"{type(err).__name__}: {err}", 1, traceback.format_exc())
        raise
    if summary is not None:
        write(summary)
    return 0


def start_worker() -> None:
    """A rank that dies by a signal (SIGABRT from C++, SIGSEGV) prints where its threads were."""
    faulthandler.enable()


def exit_worker(code: int) -> NoReturn:
    """End a worker process. A rank of a torchrun group leaves without interpreter finalization:
    its summary is written and its process group destroyed by now, and what finalization would
    still do is destroy objects that torch's C++ threads may reference (the process group that
    DDP holds), which can abort the process (SIGABRT, "terminate called without an active
    exception") after the work is done, and torchrun then kills the other ranks mid-write."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:  # not under torchrun
        sys.exit(code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
