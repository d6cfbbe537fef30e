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
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from accelab.serve.batcher import Batch, Batcher, BatchPolicy, Pending
from accelab.serve.jobs import (
    ErrorKind,
    Job,
    JobOutcome,
    WorkerThread,
    call_safely,
    deadline_error,
    is_out_of_memory,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _UnitResult:
    value: Any = None
    error: BaseException | None = None
    kind: ErrorKind | None = None


@dataclass(kw_only=True, slots=True)
class WorkerHooks:
    """What the worker reports; the server wires these to Prometheus metrics."""

    on_batch: Callable[[int, float], None] = lambda units, seconds: None
    on_retry: Callable[[str], None] = lambda reason: None
    on_depth: Callable[[int], None] = lambda depth: None
    on_limit: Callable[[int], None] = lambda limit: None


class Worker(WorkerThread[Batch[Job]]):
    def __init__(
        self,
        policy: BatchPolicy,
        *,
        clock: Callable[[], float] = time.monotonic,
        hooks: WorkerHooks | None = None,
        quiet: Callable[[], bool] = lambda: False,
    ):
        super().__init__("accelab-model-worker", clock=clock)
        self._quiet = quiet  # no request is on its way to the queue: a batch need not wait for company
        self._batcher: Batcher[Job] = Batcher(policy, clock)
        self.hooks = hooks or WorkerHooks()

    # -- called from the event loop -------------------------------------------------------
    def submit(self, job: Job) -> Pending[Job]:
        """Queue a job; raises QueueFull (answer 429) or ShuttingDown (answer 503)."""
        with self._cond:
            self._accepting()
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

    def retry_after_s(self) -> int:
        """Seconds a client turned away should wait: the time to run the queue ahead of it."""
        with self._cond:
            batches = len(self._batcher) / max(1, self._batcher.limit.value) + 1
        return self._retry_after(batches)

    # -- the worker thread ----------------------------------------------------------------
    def _take(self) -> Batch[Job] | None:
        batch = self._batcher.take(flush=self._stopping, quiet=self._quiet())
        if batch is not None:
            self.hooks.on_depth(len(self._batcher))
        return batch

    def _drained(self) -> bool:
        return not len(self._batcher)

    def _wait_s(self) -> float | None:
        return self._batcher.wait_s()

    def _run(self, batch: Batch[Job]) -> None:
        for pending in batch.expired:
            waited = self._clock() - pending.arrival
            err = deadline_error(waited, pending.payload.timeout_s)
            call_safely(pending.payload.done, JobOutcome(error=err, error_kind="timeout", queue_s=waited))
        if batch.items:
            self._run_batch(batch.items)
        self._do_chores()

    def _run_batch(self, items: list[Pending[Job]]) -> None:
        start = self._clock()
        jobs = [p.payload for p in items]
        for job in jobs:
            call_safely(job.started)
        units = [unit for job in jobs for unit in job.units]
        results = self._run_chunks(jobs[0].run, units)
        end = self._clock()
        seconds = end - start
        self._note_seconds(seconds)
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
            call_safely(job.done, outcome)

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


def _free_device_memory() -> None:
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - best effort
        pass
