"""The model worker: one thread that takes batches from the batcher and runs them, so the
event loop never waits on torch.

Failure handling, per batch of units (inputs of one or more requests):
- out of memory: the batch limit is halved and the batch is retried in chunks of the new
  limit (each split counted); one unit that still runs out of memory fails alone;
- any other error: each unit is retried alone, so one bad input fails only its own request.
  A generation unit that already streamed text cannot be replayed; it fails instead.
Every job gets exactly one `done` call, from this thread: its outputs or its error.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from accelab.serve.batcher import Batcher, BatchPolicy, Pending, QueueFull

log = logging.getLogger(__name__)

__all__ = [
    "ErrorKind",
    "Executor",
    "GenerationWorker",
    "Job",
    "JobOutcome",
    "QueueFull",
    "Worker",
    "WorkerHooks",
    "is_out_of_memory",
]

ErrorKind = Literal["oom", "model_error", "timeout", "shutdown", "cancelled"]


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


@dataclass(frozen=True, slots=True)
class _UnitResult:
    value: Any = None
    error: BaseException | None = None
    kind: ErrorKind | None = None


class DeadlineExceeded(Exception):
    pass


class ShuttingDown(Exception):
    pass


def is_out_of_memory(err: BaseException) -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return isinstance(err, MemoryError)
    return isinstance(err, (torch.OutOfMemoryError, MemoryError))


@dataclass(kw_only=True, slots=True)
class WorkerHooks:
    """What the worker reports; the server wires these to Prometheus metrics."""

    on_batch: Callable[[int, float], None] = lambda units, seconds: None
    on_retry: Callable[[str], None] = lambda reason: None
    on_depth: Callable[[int], None] = lambda depth: None
    on_limit: Callable[[int], None] = lambda limit: None


class Executor(Protocol):
    """What runs jobs: this module's Worker (batches), the continuous worker, vLLM's worker.
    `submit` hands back a handle of the executor's own kind, which only goes back to its
    `cancel`."""

    def submit(self, job: Job) -> Any: ...  # QueueFull (429), ShuttingDown (503)

    def cancel(self, handle: Any) -> bool: ...  # False once the job runs

    @property
    def depth(self) -> int: ...  # jobs queued

    def retry_after_s(self) -> int: ...


class Closeable(Protocol):
    def close(self) -> None: ...


class GenerationWorker(Executor, Protocol):
    """A worker that runs generation jobs a step at a time (ContinuousWorker, VllmWorker)."""

    @property
    def engine(self) -> Closeable: ...  # what it steps: the server closes it after `stop`

    @property
    def batch_limit(self) -> int: ...

    @property
    def alive(self) -> bool: ...

    def start(self) -> None: ...

    def stop(self, *, timeout_s: float | None = None) -> bool: ...  # True: it ended in time


class SelfSchedulingWorker(GenerationWorker, Protocol):
    """The worker of an engine whose runtime schedules every step itself (vLLM): the KV cache
    is the runtime's, and the worker says how large it is."""

    @property
    def kv_blocks(self) -> int: ...

    @property
    def kv_tokens(self) -> int: ...


class Worker:
    def __init__(
        self,
        policy: BatchPolicy,
        *,
        clock: Callable[[], float] = time.monotonic,
        hooks: WorkerHooks | None = None,
        quiet: Callable[[], bool] = lambda: False,
    ):
        self._clock = clock
        self._quiet = quiet  # no request is on its way to the queue: a batch need not wait for company
        self._batcher: Batcher[Job] = Batcher(policy, clock)
        self._cond = threading.Condition()
        self._stopping = False
        self._busy = False
        self._batch_seconds = 0.0  # moving average of one batch's run time, for Retry-After
        self.hooks = hooks or WorkerHooks()
        self._thread = threading.Thread(target=self._loop, name="accelab-model-worker", daemon=True)

    # -- called from the event loop -------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> Pending[Job]:
        """Queue a job; raises QueueFull (answer 429) or ShuttingDown (answer 503)."""
        with self._cond:
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            pending = self._batcher.add(job, key=job.key, weight=max(1, len(job.units)), timeout_s=job.timeout_s)
            self.hooks.on_depth(len(self._batcher))
            self._cond.notify()
        return pending

    def cancel(self, pending: Pending[Job]) -> bool:
        """Take a job out of the queue (deadline passed, client gone); False once it runs."""
        with self._cond:
            removed = self._batcher.cancel(pending)
            self.hooks.on_depth(len(self._batcher))
        return removed

    @property
    def depth(self) -> int:
        with self._cond:
            return len(self._batcher)

    @property
    def batch_limit(self) -> int:
        return self._batcher.limit.value

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def idle(self) -> bool:
        with self._cond:
            return not self._busy and not len(self._batcher)

    def retry_after_s(self) -> int:
        """Seconds a client turned away should wait: the time to run the queue ahead of it."""
        with self._cond:
            batches = len(self._batcher) / max(1, self._batcher.limit.value) + 1
        return max(1, math.ceil(batches * self._batch_seconds))

    def stop(self, *, timeout_s: float | None = None) -> bool:
        """Run what is queued, then end the thread; True when it ended within `timeout_s`."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # -- the worker thread ----------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                batch = self._batcher.take(flush=self._stopping, quiet=self._quiet())
                while batch is None:
                    if self._stopping and not len(self._batcher):
                        return
                    self._cond.wait(self._batcher.wait_s())
                    batch = self._batcher.take(flush=self._stopping, quiet=self._quiet())
                self._busy = bool(batch.items)
                self.hooks.on_depth(len(self._batcher))
            try:
                for pending in batch.expired:
                    self._expire(pending)
                if batch.items:
                    self._run_batch(batch.items)
            except Exception:  # the worker thread must survive anything
                log.exception("worker loop error")
            finally:
                with self._cond:
                    self._busy = False

    def _expire(self, pending: Pending[Job]) -> None:
        waited = self._clock() - pending.arrival
        err = DeadlineExceeded(
            f"request waited {waited:.1f} s in the queue, past its deadline of {pending.payload.timeout_s:g} s; "
            "raise --request-timeout or send fewer requests at once"
        )
        _call_done(pending.payload, JobOutcome(error=err, error_kind="timeout", queue_s=waited))

    def _run_batch(self, items: list[Pending[Job]]) -> None:
        start = self._clock()
        jobs = [p.payload for p in items]
        for job in jobs:
            _call(job.started)
        units = [unit for job in jobs for unit in job.units]
        results = self._run_chunks(jobs[0].run, units)
        end = self._clock()
        seconds = end - start
        self._batch_seconds = seconds if not self._batch_seconds else 0.8 * self._batch_seconds + 0.2 * seconds
        self.hooks.on_batch(len(units), seconds)
        offset = 0
        for pending, job in zip(items, jobs):
            mine = results[offset : offset + len(job.units)]
            offset += len(job.units)
            failed = next((r for r in mine if r.error is not None), None)
            outcome = JobOutcome(queue_s=start - pending.arrival, compute_s=seconds, batch_units=len(units))
            if failed is None:
                outcome = replace(outcome, outputs=[r.value for r in mine])
            else:
                outcome = replace(outcome, error=failed.error, error_kind=failed.kind)
            _call_done(job, outcome)

    def _run_chunks(self, run: Callable[[list[Any]], list[Any]], units: list[Any]) -> list[_UnitResult]:
        """Run `units` in chunks of the current limit, re-read before each chunk: a job heavier
        than the limit, or the rest of a batch after an out-of-memory, runs at the new size."""
        results: list[_UnitResult] = []
        while len(results) < len(units):
            size = self._batcher.limit.value
            results.extend(self._run_units(run, units[len(results) : len(results) + size]))
        return results

    def _run_units(self, run: Callable[[list[Any]], list[Any]], units: list[Any]) -> list[_UnitResult]:
        try:
            outputs = run(units)
            if len(outputs) != len(units):
                raise RuntimeError(f"engine returned {len(outputs)} outputs for {len(units)} inputs")
        except Exception as err:  # noqa: BLE001 - any model error is answered, not raised
            return self._recover(run, units, err)
        with self._cond:
            self._batcher.limit.note_success()
        return [_UnitResult(value=v) for v in outputs]

    def _recover(self, run: Callable[[list[Any]], list[Any]], units: list[Any], err: Exception) -> list[_UnitResult]:
        if is_out_of_memory(err):
            _free_device_memory()
            if len(units) == 1:
                log.warning("out of memory on a single input: %s", err)
                return [_UnitResult(error=err, kind="oom")]
            with self._cond:
                new_limit = self._batcher.limit.lower(len(units))
            self.hooks.on_limit(new_limit)
            self.hooks.on_retry("oom")
            log.warning(
                "out of memory at batch size %d; splitting it and trying batches of %d next", len(units), new_limit
            )
            return self._run_chunks(run, units)
        if len(units) == 1:
            log.warning("request failed: %r", err)
            return [_UnitResult(error=err, kind="model_error")]
        log.warning("a batch of %d failed (%r); running its inputs one by one", len(units), err)
        self.hooks.on_retry("batch_error")
        results = []
        for unit in units:
            if getattr(unit, "emitted", False):  # already streamed text: a replay would repeat it
                results.append(_UnitResult(error=err, kind="model_error"))
            else:
                results.extend(self._run_units(run, [unit]))
        return results


def _call_done(job: Job, outcome: JobOutcome) -> None:
    _call(job.done, outcome)


def _call(callback: Callable[..., None], *args: Any) -> None:
    try:
        callback(*args)
    except Exception:  # one broken callback must not stop the worker
        log.exception("job callback failed")


def _free_device_memory() -> None:
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - best effort
        pass
