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
# what a node without global rank 0 says: its ranks finished, and the run's result is on another node
ELSEWHERE = "this node's ranks finished; the node that holds global rank 0 writes the run's result"


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


def outcome_elsewhere(outcome: Any) -> bool:
    """True (and says so) when this node's ranks finished and the result is another node's to
    write: a multi-node run writes one Result (--json, the store), on the node of global rank 0."""
    if outcome is None or outcome.status != "ok" or outcome.summary is not None or outcome.reason != ELSEWHERE:
        return False
    print(f"accelab: {ELSEWHERE}", file=sys.stderr)
    return True


def refuse_outer_launcher(command: str, environ: dict[str, str] | None = None) -> None:
    """ValueError when `accelab <command>` itself was started by `accelerate launch` or torchrun.
    accelab starts its own workers: under torchrun every one of those processes would run the
    whole job again, and `accelerate launch` with a CPU config starts just one process (without
    a rank) whatever num_processes says. The message gives the accelab command line instead."""
    env = os.environ if environ is None else environ
    if "ACCELERATE_DYNAMO_BACKEND" in env:  # set by `accelerate launch` only, never by Accelerator()
        where = f"{env.get('MASTER_ADDR', 'HOST')}:{env.get('MASTER_PORT', 'PORT')}"
        raise ValueError(
            f"accelab {command} was started by accelerate launch: accelab starts its own worker processes, and "
            "accelerate launch with a CPU config starts one process here whatever num_processes says, so the run "
            f"would not be the one your config file describes. Run it without the launcher: accelab {command} ... "
            f"--nproc N (your config's num_processes); on several machines add --nnodes M --rdzv-backend c10d "
            f"--rdzv-endpoint {where} --rdzv-id RUN_ID, the same on each"
        )
    if "LOCAL_RANK" not in env and int(env.get("WORLD_SIZE", "1")) <= 1:
        return
    world = int(env.get("WORLD_SIZE", "1"))
    local = int(env.get("LOCAL_WORLD_SIZE", "1") or 1)
    nodes = max(1, world // max(local, 1))
    rendezvous = ""
    if nodes > 1:
        where = f"{env.get('MASTER_ADDR', 'HOST')}:{env.get('MASTER_PORT', 'PORT')}"
        rendezvous = f" --nnodes {nodes} --rdzv-backend c10d --rdzv-endpoint {where} --rdzv-id RUN_ID"
    raise ValueError(
        f"accelab {command} was started by torchrun (WORLD_SIZE={world}, LOCAL_RANK={env.get('LOCAL_RANK', '?')}): "
        f"it starts its own worker processes, so each of these {world} would run the whole job again. Run it once "
        f"per machine instead, without the launcher: accelab {command} ... --nproc {local}{rendezvous}"
    )
