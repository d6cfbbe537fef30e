"""What the routes hand to a worker, and the skeleton every worker shares.

A request becomes a `Job` (its units: one per input or per generated sequence) that an
`Executor` runs: the static `Worker` (batches of one model call), the `ContinuousWorker`
(sequences of the step scheduler) or the `EngineProcessWorker` (vLLM, OpenVINO GenAI: the
engine schedules). Their contract is the same: `submit` answers at once (QueueFull: 429,
ShuttingDown: 503, PayloadTooLarge: 413), every job gets exactly one `done` with a
`JobOutcome`, and `cancel` takes a job back while none of it runs.

`WorkerThread` is their common skeleton: one thread that takes work under a condition,
runs it outside the lock and survives anything a step raises; `stop` lets what is queued and
running finish. `JobRun` is the bookkeeping of one generation job while its sequences run
(admission, completions, the one `done`), shared by the two generation workers.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar

from accelab.serve.batcher import QueueFull

log = logging.getLogger(__name__)

__all__ = [
    "ClientGone",
    "DeadlineExceeded",
    "ErrorKind",
    "Executor",
    "GenerationWorker",
    "Job",
    "JobOutcome",
    "JobRun",
    "QueueFull",
    "SelfSchedulingWorker",
    "ShuttingDown",
    "WorkerThread",
    "call_safely",
    "is_out_of_memory",
]

ErrorKind = Literal["oom", "model_error", "timeout", "shutdown", "cancelled"]
W = TypeVar("W")  # what a worker's thread takes at a time: a batch, a scheduled step, ...
R = TypeVar("R")  # a generation worker's per-sequence row
T = TypeVar("T")  # what a `between_steps` call returns


@dataclass(kw_only=True, slots=True, eq=False)
class Job:
    """One request's work. Its units run in batches with the units of other jobs of its key;
    `run(units) -> outputs` (one output per unit) is called in the worker thread."""

    key: str
    units: list[Any]
    run: Callable[[list[Any]], list[Any]]
    done: Callable[[JobOutcome], None]
    started: Callable[[], None] = lambda: None  # its batch begins (a stream can send headers)
    timeout_s: float | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class JobOutcome:
    outputs: list[Any] = field(default_factory=list)  # one per unit (none when it failed)
    error: BaseException | None = None
    error_kind: ErrorKind | None = None
    queue_s: float = 0.0  # arrival to the start of its batch
    compute_s: float = 0.0  # the start of its batch to its end
    batch_units: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None


class DeadlineExceeded(Exception):
    pass


class ShuttingDown(Exception):
    pass


class ClientGone(Exception):
    pass


def deadline_error(waited: float, timeout_s: float | None, where: str = "the queue") -> DeadlineExceeded:
    return DeadlineExceeded(
        f"request waited {waited:.1f} s in {where}, past its deadline of {timeout_s:g} s; "
        "raise --request-timeout or send fewer requests at once"
    )


def is_out_of_memory(err: BaseException) -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return isinstance(err, MemoryError)
    return isinstance(err, (torch.OutOfMemoryError, MemoryError))


def error_kind(err: BaseException) -> ErrorKind:
    return "oom" if is_out_of_memory(err) else "model_error"


def call_safely(callback: Callable[..., Any], *args: Any) -> None:
    """A job's or a hook's callback, from a worker thread: one that raises must not stop the worker."""
    try:
        callback(*args)
    except Exception:
        log.exception("callback failed")


class Executor(Protocol):
    """What runs jobs. `submit` hands back a handle of the executor's own kind, which only goes
    back to its `cancel`."""

    def submit(self, job: Job) -> Any: ...  # QueueFull (429), ShuttingDown (503)

    def cancel(self, handle: Any) -> bool: ...  # False once the job runs

    @property
    def depth(self) -> int: ...  # jobs queued

    def retry_after_s(self) -> int: ...


class Closeable(Protocol):
    def close(self) -> None: ...


class GenerationWorker(Executor, Protocol):
    """A worker that runs generation jobs a step at a time (ContinuousWorker, EngineProcessWorker)."""

    @property
    def engine(self) -> Closeable: ...  # what it steps: the server closes it after `stop`

    @property
    def batch_limit(self) -> int: ...

    @property
    def alive(self) -> bool: ...

    def start(self) -> None: ...

    def stop(self, *, timeout_s: float | None = None) -> bool: ...  # True: it ended in time


class SelfSchedulingWorker(GenerationWorker, Protocol):
    """The worker of an engine whose runtime schedules every step itself (vLLM, OpenVINO GenAI):
    the KV cache is the runtime's, and the worker says how large it is."""

    @property
    def kv_blocks(self) -> int: ...

    @property
    def kv_tokens(self) -> int: ...


class WorkerThread(Generic[W]):
    """One thread that takes work under `_cond` (`_take`: None when there is none; it waits
    `_wait_s`, None: until notified) and runs it outside the lock (`_run`); a failure there is
    logged and the thread goes on. After `stop` it runs until nothing is left (`_drained`).
    `submit` paths call `_accepting` under the lock. The moving average of a unit of work's
    seconds (`_note_seconds`) sizes Retry-After.

    `between_steps` runs other CPU work (a request's image preprocessing) on this thread
    between two units of work, so it never runs beside the model: on a CPU the model's
    parallel regions use every core, and a thread beside them stalls each region for as long
    as it holds a core (measured on 2 cores: a 26 ms decoding step took 53 ms while a 10 ms
    image preprocessing ran in a thread; on this thread it costs its own 10 ms). The thread
    runs them when it has no other work, and a worker's `_run` calls `_do_chores` where they fit."""

    def __init__(self, name: str, *, clock: Callable[[], float] = time.monotonic, lock: Any = None):
        self._clock = clock
        self._cond = threading.Condition(lock)
        self._stopping = False
        self._busy = False
        self._seconds = 0.0  # moving average of one unit of work (a batch, a sequence)
        self._chores: deque[tuple[Callable[[], Any], Future[Any]]] = deque()  # `between_steps` calls
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    # -- what a worker defines ------------------------------------------------------------
    def _take(self) -> W | None:
        raise NotImplementedError

    def _run(self, work: W) -> None:
        raise NotImplementedError

    def _drained(self) -> bool:
        raise NotImplementedError

    def _wait_s(self) -> float | None:
        return None

    def _chores_wait(self) -> bool:
        """Outside the lock: the `between_steps` calls left wait for the next unit of work."""
        return False

    # -- the skeleton ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def idle(self) -> bool:
        with self._cond:
            return not self._busy and not self._chores and self._drained()

    def stop(self, *, timeout_s: float | None = None) -> bool:
        """Finish what is queued and running, then end the thread; True when it ended in time."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def between_steps(self, fn: Callable[[], T]) -> Future[T]:
        """`fn` run on this thread between two units of work; its result or error comes in the
        future (cancelled before it ran: it never runs). ShuttingDown once `stop` was called."""
        future: Future[T] = Future()
        with self._cond:
            self._accepting()
            self._chores.append((fn, future))
            self._cond.notify()
        return future

    def _do_chores(self) -> None:
        """The queued `between_steps` calls: one at least, then until `_chores_wait` says the
        next unit of work goes first."""
        ran = False
        while True:
            if ran and self._chores_wait():
                return
            with self._cond:
                if not self._chores:
                    return
                fn, future = self._chores.popleft()
            ran = True
            if not future.set_running_or_notify_cancel():  # its request went away meanwhile
                continue
            try:
                result = fn()
            except Exception as err:  # noqa: BLE001 - the caller's error, raised where it waits
                future.set_exception(err)
            else:
                future.set_result(result)

    def _accepting(self) -> None:
        """Under the lock, before queueing a job: ShuttingDown (503) once `stop` was called."""
        if self._stopping:
            raise ShuttingDown("the server is shutting down")

    def _note_seconds(self, seconds: float) -> None:
        self._seconds = seconds if not self._seconds else 0.8 * self._seconds + 0.2 * seconds

    def _retry_after(self, rounds: float) -> int:
        return max(1, math.ceil(rounds * self._seconds))

    def _loop(self) -> None:
        while True:
            with self._cond:
                work = self._take()
                while work is None and not self._chores:
                    if self._stopping and self._drained():
                        return
                    self._cond.wait(self._wait_s())
                    work = self._take()
                self._busy = True
            try:
                if work is None:
                    self._do_chores()
                else:
                    self._run(work)
            except Exception:  # the worker thread must survive anything
                log.exception("%s: error", self._thread.name)
            finally:
                with self._cond:
                    self._busy = False


@dataclass(kw_only=True, slots=True, eq=False)
class JobRun(Generic[R]):
    """A submitted generation job while its sequences (`rows`) run: admitted once (its first
    sequence starts), answered once (`finish` when every row completed, or `failure`)."""

    job: Job
    arrival: float
    rows: list[R] = field(default_factory=list)
    completions: dict[int, Any] = field(default_factory=dict)  # row index -> Completion
    admitted_at: float | None = None
    done: bool = False

    def admit(self, now: float) -> bool:
        """Its first sequence starts: True (and the job's `started` is called) the first time."""
        if self.admitted_at is not None:
            return False
        self.admitted_at = now
        call_safely(self.job.started)
        return True

    def complete(self, index: int, completion: Any) -> bool:
        """Row `index` finished; True when that was the last one and the job is not answered yet."""
        self.completions[index] = completion
        return len(self.completions) == len(self.rows) and not self.done

    def finish(self, now: float, *, batch_units: int) -> float:
        """Answer the job with its completions; returns its seconds from admission to now."""
        self.done = True
        admitted = self.admitted_at if self.admitted_at is not None else now
        seconds = now - admitted
        outcome = JobOutcome(
            outputs=[self.completions[i] for i in range(len(self.rows))],
            queue_s=admitted - self.arrival,
            compute_s=seconds,
            batch_units=batch_units,
        )
        call_safely(self.job.done, outcome)
        return seconds

    def failure(self, error: BaseException, kind: ErrorKind, now: float) -> None:
        """Answer the job with `error` (the caller checked `done` and stops its rows)."""
        self.done = True
        queue_s = (self.admitted_at or now) - self.arrival
        call_safely(self.job.done, JobOutcome(error=error, error_kind=kind, queue_s=queue_s))
