"""Worker processes shared by `accelab train` and `accelab predict`: the launch options, the
command line, the workers' environment, how the parent starts, watches and stops them (one
Outcome, one kill policy), and how a worker ends (its exit codes and the summary rank 0 leaves
for the parent).

One process runs `python -m WORKER CONFIG.json`. Several (`--nproc`, `--nnodes`) run under
torchrun (`python -m torch.distributed.run`, the same interpreter) with the multi-node options
passed through; one node without rendezvous options uses `--standalone`, a free local port, so
concurrent runs on one machine do not collide.

The parent blocks on the launched process (never spins), with a timeout. Kill policy, the same
for train and predict: see `_start` and `_stop`.
"""

from __future__ import annotations

import ctypes
import faulthandler
import json
import logging
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, NoReturn

from accelab.options import fields_of, option

log = logging.getLogger(__name__)

EXIT_USER_ERROR = 2
EXIT_UNSUPPORTED = 3
# what a node without global rank 0 says: its ranks finished, and the run's result is on another node
ELSEWHERE = "this node's ranks finished; the node that holds global rank 0 writes the run's result"
STOP_GRACE_S = 15  # SIGTERM, then this long for torchrun to stop its ranks, then SIGKILL

Status = Literal["ok", "error", "unsupported", "timeout", "crashed"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchOptions:
    """The processes of `accelab train` and `predict`; each field declares its option."""

    nproc: int = field(
        default=1,
        metadata=option("Processes on this node (data parallel through torchrun when > 1; one per GPU).", "--nproc"),
    )
    nnodes: int = field(
        default=1, metadata=option("Nodes; run the same command on each, output on a shared disk.", "--nnodes")
    )
    node_rank: int | None = field(default=None, metadata=option(None, "--node-rank"))
    master_addr: str | None = field(default=None, metadata=option(None, "--master-addr"))
    master_port: int | None = field(default=None, metadata=option(None, "--master-port"))
    rdzv_backend: str | None = field(
        default=None,
        metadata=option(
            "torchrun rendezvous (c10d: every node runs the same command, no --node-rank needed).", "--rdzv-backend"
        ),
    )
    rdzv_endpoint: str | None = field(default=None, metadata=option("HOST:PORT of the rendezvous.", "--rdzv-endpoint"))
    rdzv_id: str | None = field(default=None, metadata=option("The job's id, the same on every node.", "--rdzv-id"))
    rdzv_conf: str | None = field(default=None, metadata=option(None, "--rdzv-conf"))

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ValueError(f"--nproc {self.nproc} must be 1 or more")
        if self.nnodes < 1:
            raise ValueError(f"--nnodes {self.nnodes} must be 1 or more")
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"--node-rank {self.node_rank} must be within 0..{self.nnodes - 1} (--nnodes {self.nnodes})"
            )
        if self.nnodes > 1 and not (self.master_addr or self.rdzv_endpoint):
            raise ValueError(
                f"--nnodes {self.nnodes} needs --master-addr HOST (and --node-rank on every node), "
                "or --rdzv-endpoint HOST:PORT with --rdzv-backend c10d"
            )

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> LaunchOptions:
        """From a command's options by name (`accelab train` and `predict` name them like the fields)."""
        return cls(**fields_of(cls, options))

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


@dataclass(frozen=True, kw_only=True, slots=True)
class Outcome:
    """How a launch ended; `summary` is global rank 0's report when it is "ok" on this node."""

    status: Status
    summary: dict[str, Any] | None
    reason: str | None
    wall_s: float
    command: list[str] | None  # None: ran in this process
    returncode: int | None  # None: stopped on timeout, or ran in this process


def worker_command(module: str, config_path: Path, launch: LaunchOptions) -> list[str]:
    """`python -m MODULE CONFIG` for one process, torchrun running it on each rank for several."""
    worker = ["-m", module, str(config_path)]
    return torchrun_command(launch, worker) if launch.distributed else [sys.executable, *worker]


def torchrun_command(launch: LaunchOptions, worker: list[str]) -> list[str]:
    """torchrun running `python <worker...>` on launch.nproc ranks of this node."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(launch.nproc)]
    rendezvous = (launch.master_addr, launch.master_port, launch.rdzv_backend, launch.rdzv_endpoint)
    if launch.nnodes == 1 and all(v is None for v in rendezvous):
        cmd.append("--standalone")
    else:
        cmd += ["--nnodes", str(launch.nnodes)]
        for flag, value in (
            ("--node_rank", launch.node_rank),
            ("--master_addr", launch.master_addr),
            ("--master_port", launch.master_port),
            ("--rdzv_backend", launch.rdzv_backend),
            ("--rdzv_endpoint", launch.rdzv_endpoint),
            ("--rdzv_id", launch.rdzv_id),
            ("--rdzv_conf", launch.rdzv_conf),
        ):
            if value is not None:
                cmd += [flag, str(value)]
    return [*cmd, *worker]


def worker_env(threads: int | None) -> dict[str, str]:
    """The workers' environment: offline, quiet, and OMP_NUM_THREADS = the run's threads
    (torchrun alone would pin every rank to 1 thread; the worker also sets torch's)."""
    env = dict(os.environ)
    for key, value in (
        ("HF_HUB_OFFLINE", "1"),
        ("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1"),
        ("TOKENIZERS_PARALLELISM", "false"),
    ):
        env.setdefault(key, value)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


# -- the parent: start, watch, stop -------------------------------------------------------------
def run_workers(
    command: list[str], *, summary_path: Path, threads: int | None, timeout_s: float, what: str, kept: str | None = None
) -> Outcome:
    """Start `command`, block until it exits or `timeout_s` passes, stop whatever of it is left,
    and read the summary global rank 0 wrote to `summary_path`. `what` names the run in the
    timeout message; `kept` says what a rerun keeps of a run that did not finish."""
    log.info("starting %s", " ".join(command))
    start = time.perf_counter()
    proc = _start(command, worker_env(threads))
    try:
        returncode = proc.wait(timeout=timeout_s)  # blocks; no polling loop
    except subprocess.TimeoutExpired:
        return Outcome(
            status="timeout",
            summary=None,
            returncode=None,
            command=command,
            reason=f"{what} did not finish within {timeout_s:.0f} s; raise --timeout{_kept(kept)}",
            wall_s=time.perf_counter() - start,
        )
    finally:
        _stop(proc)  # also on Ctrl-C (KeyboardInterrupt), which reaches only this process
    return _outcome(summary_path, returncode, command, time.perf_counter() - start, kept)


def _start(command: list[str], env: dict[str, str]) -> subprocess.Popen:
    """The kill policy, one for train and predict. The launched process (torchrun, or the one
    worker) leads a session of its own, so the parent owns a process group it can end whole on
    timeout or Ctrl-C (`_stop`), whatever the workers started in it, and a terminal's Ctrl-C
    does not race that stop by signalling torchrun as well. A group alone does not cover a
    parent killed outright (SIGKILL, the OOM killer: no `finally` runs), so the launched process
    also gets SIGTERM when the parent dies (PR_SET_PDEATHSIG); torchrun then stops its ranks.
    torchrun puts each rank in a session of its own (and kills those itself on SIGTERM), so each
    rank in turn dies with torchrun (`start_worker`): no rank outlives the run to write beside a
    resumed one. Signalling only the child and relying on the parent-death signal alone (what
    predict did) left anything else in the group running."""
    # preexec_fn runs between fork and exec: it calls only prctl (looked up beforehand) and getppid, no lock
    die_with_parent = _die_with_parent(signal.SIGTERM, parent=os.getpid())
    return subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=die_with_parent)  # noqa: PLW1509 - see above


def _stop(proc: subprocess.Popen) -> None:
    """End the launched process group: SIGTERM (torchrun stops its ranks), SIGKILL after
    STOP_GRACE_S; then SIGKILL whatever is left in the group (a worker's own children)."""
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(proc.pid, signal.SIGKILL)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # stuck in the kernel (a hung device, NFS): nothing more to send
        log.warning("pid %d did not end after SIGKILL", proc.pid)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)  # pgid = the launched process's pid: it leads its own session
    except ProcessLookupError:  # nothing left in the group
        pass


def _die_with_parent(sig: signal.Signals, parent: int) -> Callable[[], None] | None:
    """A function that makes the calling process get `sig` when its parent (pid `parent`) dies,
    even by SIGKILL (Linux PR_SET_PDEATHSIG), and exit at once if it died before that took effect.
    None elsewhere. The signal comes when the parent's *thread* that started the process ends:
    launch from a thread that outlives the run (the main thread does)."""
    if not sys.platform.startswith("linux"):
        return None

    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def arm() -> None:
        prctl(1, sig)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)

    return arm


def _outcome(summary_path: Path, returncode: int, command: list[str], wall: float, kept: str | None) -> Outcome:
    doc: dict[str, Any] | None = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    status = (doc or {}).get("status")
    ended = Outcome(status="crashed", summary=None, reason=None, returncode=returncode, wall_s=wall, command=command)
    if returncode == 0 and status == "ok":
        return replace(ended, status="ok", summary=doc)
    if returncode == 0 and doc is None:  # a node without global rank 0: the summary is written on node 0
        return replace(ended, status="ok", reason=ELSEWHERE)
    if doc is not None and status in ("error", "unsupported"):
        return replace(ended, status=status, reason=doc.get("reason"))
    torchrun = command[1:3] == ["-m", "torch.distributed.run"]
    who, output = ("torchrun", "the ranks' output") if torchrun else ("worker", "its output")
    why = f"{who} exited with code {returncode}" if returncode >= 0 else f"{who} killed by signal {-returncode}"
    return replace(ended, reason=f"{why} without a result; see {output} above{_kept(kept)}")


def _kept(kept: str | None) -> str:
    return f" ({kept})" if kept else ""


# -- the worker: run a rank, end it --------------------------------------------------------------
def run_worker(
    job: Callable[[], dict[str, Any] | None],
    *,
    rank: int,
    world_size: int,
    write: Callable[[dict[str, Any]], None],
    unsupported: type[BaseException],
) -> int:
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
    """A rank that dies by a signal (SIGABRT from C++, SIGSEGV) prints where its threads were.
    A rank of a torchrun group dies with torchrun's agent (even by SIGKILL; the kill policy at
    `_start`) instead of running on as an orphan that keeps writing beside a resumed run."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        parent = os.getppid()
        if parent == 1:  # torchrun died before this rank got here
            os._exit(1)
        arm = _die_with_parent(signal.SIGKILL, parent)
        if arm is not None:
            arm()
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
