"""Run one job in a fresh spawned child process.

Why a child per (model, plan, workload): accelerate's state is a process singleton, `prepare()`
rewrites the model in place, compile and quantization are one-way, and memory peaks must not
bleed between runs. The parent blocks on the pipe with a timeout (it never spins: a spinning
parent steals a core from the measurement) and turns every way a child can end into a
`ChildOutcome`, so a crash, an OOM or a hang is a result, never a hang of the caller.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Literal

import psutil

from accelab.quiet import quiet_third_party_process_wide

log = logging.getLogger(__name__)

Status = Literal["ok", "error", "oom", "timeout", "crashed"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ChildJob:
    target: str  # "package.module:function", called as function(payload)
    payload: Any = None  # picklable; a small dataclass
    timeout_s: float = 1800.0
    env: dict[str, str] = field(default_factory=dict)  # set in the child before the target is imported


@dataclass(frozen=True, kw_only=True, slots=True)
class ChildOutcome:
    status: Status
    value: Any = None
    reason: str | None = None
    traceback: str | None = None
    exitcode: int | None = None
    wall_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def unwrap(self) -> Any:
        """The child's return value, or a ChildError carrying the child's traceback."""
        if self.ok:
            return self.value
        raise ChildError(self)


class ChildError(RuntimeError):
    def __init__(self, outcome: ChildOutcome):
        self.outcome = outcome
        detail = f"\n--- child traceback ---\n{outcome.traceback}" if outcome.traceback else ""
        super().__init__(f"child process {outcome.status}: {outcome.reason}{detail}")


@dataclass(frozen=True, kw_only=True, slots=True)
class _Message:
    status: Status
    value: Any = None
    reason: str | None = None
    traceback: str | None = None


def _is_oom(err: BaseException) -> bool:
    if isinstance(err, MemoryError):
        return True
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return isinstance(err, torch.OutOfMemoryError)


def _child_main(conn: Any, job: ChildJob) -> None:
    os.environ.update(job.env)
    quiet_third_party_process_wide()  # a spawned child's entry point; keeps the variables it inherited
    try:
        module_name, func_name = job.target.split(":")
        func = getattr(importlib.import_module(module_name), func_name)
        message = _Message(status="ok", value=func(job.payload))
    except BaseException as err:  # noqa: BLE001 - everything is reported to the parent
        status: Status = "oom" if _is_oom(err) else "error"
        message = _Message(
            status=status, reason=f"{type(err).__name__}: {err}".strip(), traceback=traceback.format_exc()
        )
    try:
        conn.send(message)
    except Exception as err:  # noqa: BLE001 - an unpicklable value (any error): report it instead of dying silently
        conn.send(_Message(status="error", reason=f"child result could not be sent back: {err}"))
    finally:
        conn.close()


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "child did not exit"
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        hint = " (the kernel's out-of-memory killer sends this)" if -code == signal.SIGKILL else ""
        return f"child killed by {name}{hint}"
    return f"child exited with code {code} without a result"


def _kill_tree(proc: mp.process.BaseProcess) -> None:
    """Terminate the child and everything it started (compile workers, dataloader workers)."""
    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    for p in [*descendants]:
        try:
            p.kill()
        except psutil.Error:
            pass
    proc.terminate()
    proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


@contextlib.contextmanager
def _main_not_rerun() -> Any:
    """While a child starts: hide the parent's __main__ from spawn, which would otherwise run
    the parent's script (or `-m` module) again in every child. A child runs an accelab target on
    a pickled payload and never needs it (model objects travel as cloudpickle files, by value),
    and a user's script that calls accelab.bench at top level, without an `if __name__ ==
    "__main__":` guard, would make each child start children of its own (multiprocessing
    refuses that: "before the current process has finished its bootstrapping phase")."""
    main = sys.modules.get("__main__")
    saved = {name: getattr(main, name) for name in ("__file__", "__spec__") if hasattr(main, name)}
    try:
        if main is not None and "__file__" in saved:
            del main.__file__
        if main is not None and "__spec__" in saved:
            main.__spec__ = None
        yield
    finally:
        for name, value in saved.items():
            setattr(main, name, value)


def run_isolated(job: ChildJob) -> ChildOutcome:
    """Run `job` in a spawned child and wait for it, blocking, at most `job.timeout_s`."""
    ctx = mp.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_main, args=(sender, job), name=f"accelab:{job.target}")
    start = time.perf_counter()
    with _main_not_rerun():
        proc.start()
    sender.close()  # the child holds the only writer: EOF on the pipe means it died
    log.info("started child %s (pid %s) for %s", proc.name, proc.pid, job.target)
    try:
        message: _Message | None = None
        if receiver.poll(job.timeout_s):  # blocks; wakes on a message or on EOF
            try:
                message = receiver.recv()
            except EOFError:
                message = None
        else:
            _kill_tree(proc)
            return ChildOutcome(
                status="timeout",
                reason=f"no result after {job.timeout_s:.0f} s; raise the timeout (--timeout) if the run is just slow",
                exitcode=proc.exitcode,
                wall_seconds=time.perf_counter() - start,
            )
        proc.join(30)
        wall = time.perf_counter() - start
        if message is None:
            return ChildOutcome(
                status="crashed", reason=_describe_exit(proc.exitcode), exitcode=proc.exitcode, wall_seconds=wall
            )
        return ChildOutcome(
            status=message.status,
            value=message.value,
            reason=message.reason,
            traceback=message.traceback,
            exitcode=proc.exitcode,
            wall_seconds=wall,
        )
    finally:
        receiver.close()
        if proc.is_alive():
            _kill_tree(proc)
