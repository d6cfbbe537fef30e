"""A warm child: one spawned process that loads once and then answers requests, so several
plans can stay loaded side by side and be measured in alternating rounds (A B ... B A).

The same isolation as `run_isolated` (one plan per process: accelerate's state is a process
singleton, compile and quantization are one-way, memory peaks must not mix), the same blocking
waits (the parent never spins) and the same outcomes: every request gets a `ChildOutcome`, and a
crash, an OOM or a hang is an answer for that child, never a hang of the caller.

    with WarmChild("pkg.module:Handler", payload) as child:
        child.call(Load(), timeout_s=600).unwrap()
        child.call(Round(...), timeout_s=60)

`target` names a callable that takes the payload and returns the handler: an object whose
`handle(request)` answers each request (both sides are small picklable dataclasses).
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing as mp
import os
import time
import traceback
from dataclasses import dataclass
from typing import Any

from accelab.measure.runner import ChildOutcome, _describe_exit, _is_oom, _kill_tree, _main_not_rerun, _Message
from accelab.quiet import quiet_third_party_process_wide

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Start:
    target: str
    payload: Any
    env: dict[str, str]


def _failure(err: BaseException) -> _Message:
    return _Message(
        status="oom" if _is_oom(err) else "error",
        reason=f"{type(err).__name__}: {err}".strip(),
        traceback=traceback.format_exc(),
    )


def _session_main(conn: Any, start: _Start) -> None:
    os.environ.update(start.env)
    quiet_third_party_process_wide()  # a spawned child's entry point
    try:
        module_name, func_name = start.target.split(":")
        handler = getattr(importlib.import_module(module_name), func_name)(start.payload)
        conn.send(_Message(status="ok"))
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        conn.send(_failure(err))
        conn.close()
        return
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the parent went away
            break
        if request is None:
            break
        try:
            message = _Message(status="ok", value=handler.handle(request))
        except BaseException as err:  # noqa: BLE001 - reported to the parent, the child goes on
            message = _failure(err)
        try:
            conn.send(message)
        except Exception as err:  # noqa: BLE001 - an unpicklable value (any error): report it
            conn.send(_Message(status="error", reason=f"child result could not be sent back: {err}"))
    conn.close()


class WarmChild:
    """One warm child process (see the module docstring)."""

    def __init__(
        self, target: str, payload: Any = None, *, env: dict[str, str] | None = None, start_timeout_s: float = 600.0
    ) -> None:
        self.target = target
        self._start = _Start(target=target, payload=payload, env=env or {})
        self._start_timeout_s = start_timeout_s
        self._proc: mp.process.BaseProcess | None = None
        self._conn: Any = None
        self.dead: ChildOutcome | None = None  # how it ended, once it did

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> ChildOutcome:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=_session_main, args=(child, self._start), name=f"accelab:{self.target}")
        with _main_not_rerun():
            self._proc.start()
        child.close()
        self._conn = parent
        log.info("started warm child %s (pid %s)", self.target, self._proc.pid)
        outcome = self._wait(self._start_timeout_s, "start")
        if not outcome.ok:
            self.dead = outcome
            self.close(kill=True)
        return outcome

    def call(self, request: Any, timeout_s: float) -> ChildOutcome:
        """Send one request and wait for its answer, blocking, at most `timeout_s`."""
        if self.dead is not None:
            return self.dead
        if self._conn is None:
            raise RuntimeError("WarmChild.call before start()")
        try:
            self._conn.send(request)
        except (BrokenPipeError, OSError):
            return self._ended(time.perf_counter())
        return self._wait(timeout_s, type(request).__name__)

    def _wait(self, timeout_s: float, what: str) -> ChildOutcome:
        start = time.perf_counter()
        if not self._conn.poll(timeout_s):  # blocks; wakes on a message or on EOF
            wall = time.perf_counter() - start
            self.close(kill=True)  # it is busy or hung: asking it to exit would wait for nothing
            self.dead = ChildOutcome(
                status="timeout", wall_seconds=wall, reason=f"{what}: no answer after {timeout_s:.0f} s"
            )
            return self.dead
        try:
            message: _Message = self._conn.recv()
        except (EOFError, OSError):
            return self._ended(start)
        return ChildOutcome(
            status=message.status,
            value=message.value,
            reason=message.reason,
            traceback=message.traceback,
            wall_seconds=time.perf_counter() - start,
        )

    def _ended(self, start: float) -> ChildOutcome:
        assert self._proc is not None
        self._proc.join(10)
        self.dead = ChildOutcome(
            status="crashed",
            reason=_describe_exit(self._proc.exitcode),
            exitcode=self._proc.exitcode,
            wall_seconds=time.perf_counter() - start,
        )
        return self.dead

    def close(self, *, kill: bool = False) -> None:
        """Ask the child to exit; kill it (and what it started) if it does not, or at once."""
        if self._proc is None:
            return
        if self._conn is not None and not kill:
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(10)
        if self._proc.is_alive():
            _kill_tree(self._proc)
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> WarmChild:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
