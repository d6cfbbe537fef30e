"""The executor of `accelab serve --plan vllm` (and of OpenVINO GenAI plans, whose engine process
speaks the same wire): jobs go to the engine, which schedules them.

It takes the server's `Job`s like the continuous worker (`accelab.serve.continuous`) and keeps
the same contract (every job gets exactly one `done`; 429 / 413 / 503 at submit; a job that waited
past its deadline without a token gets "timeout"; a cancelled unit stops), but the scheduling is
vLLM's: continuous batching, chunked prefill and its paged KV cache, inside the engine process.
accelab keeps what the client sees: the tokenizer, each row's TextStream (the streamed text and
stop strings), the limits and the metrics. The engine applies the request's StopRules (end of
sequence, stop token ids, min_tokens, max_tokens) in its own sampler; the worker applies the same
rules to each token it receives, so a row ends on the same token whichever side sees it first.
A row that accelab ends before the engine does (a stop string) is aborted there.

"Admitted" here means the row's first token arrived: vLLM does not report a request leaving its
queue, and until its prefill is done a request has cost the client nothing but waiting.
Threads: `submit`/`cancel` come from the event loop, tokens from the client's reader thread, and
the worker's own thread (every 50 ms) ends rows whose client went away and jobs past their deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from accelab.backends import engine_wire as W
from accelab.serve.engines.base import SAMPLING_EPS, ContinuousHooks, GenUnit, PayloadTooLarge, StepReport
from accelab.serve.engines.delivery import completion, deliver
from accelab.serve.jobs import (
    ClientGone,
    ErrorKind,
    Job,
    JobRun,
    QueueFull,
    WorkerThread,
    call_safely,
    deadline_error,
)
from accelab.serve.stops import StopRules
from accelab.serve.textstream import TextStream, stream_for

log = logging.getLogger(__name__)

SWEEP_S = 0.05


@dataclass(kw_only=True, slots=True, eq=False)
class _Row:
    unit: GenUnit
    stream: TextStream
    stops: StopRules
    run: JobRun[_Row]
    index: int
    request_id: str
    last_token_at: float | None = None
    done: bool = False


class VllmWorker(WorkerThread[list[JobRun[_Row]]]):
    def __init__(
        self,
        client: Any,
        *,
        max_queue: int,
        decode: Callable[[Sequence[int]], str],
        eos_ids: Sequence[int],
        hooks: ContinuousHooks | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        # the reader thread's callbacks take the lock again inside the worker's own calls
        super().__init__("accelab-engine-sweeper", clock=clock, lock=threading.RLock())
        self.client = client
        self.engine = client  # the state closes `worker.engine` after the worker stopped
        self.max_queue = max_queue
        self._decode, self._eos_ids = decode, tuple(eos_ids)
        self.hooks = hooks or ContinuousHooks()
        info = client.info
        self.kv_tokens = info.kv_blocks * info.block_size
        self.max_running = info.max_num_seqs
        self._runs: set[JobRun[_Row]] = set()
        self._waiting = 0  # rows without a first token
        self._sampled = 0  # tokens since the last Stats
        self._last_stats = clock()

    # -- called from the event loop -------------------------------------------------------------
    def start(self) -> None:
        self.client.watch(self._on_stats)
        super().start()

    def submit(self, job: Job) -> JobRun[_Row]:
        """Send a job's rows to vLLM; QueueFull (429), ShuttingDown (503) or PayloadTooLarge (413:
        a row that could not fit vLLM's KV cache even alone)."""
        for unit in job.units:
            need = len(unit.prompt.ids) + unit.params.max_tokens
            if need > self.kv_tokens:
                raise PayloadTooLarge(
                    f"prompt ({len(unit.prompt.ids)} tokens) + max_tokens ({unit.params.max_tokens}) "
                    f"needs {need} tokens of KV cache; vLLM's holds {self.kv_tokens} "
                    "(vllm_kv_cache_gib): lower max_tokens or shorten the prompt"
                )
        run: JobRun[_Row] = JobRun(job=job, arrival=self._clock())
        with self._cond:
            self._accepting()
            if self._waiting + len(job.units) > self.max_queue:  # all of the job or none
                raise QueueFull(f"{self._waiting} sequences are waiting (max_queue={self.max_queue})")
            run.rows = [
                _Row(
                    unit=unit,
                    stream=stream_for(unit.params, self._decode),
                    stops=StopRules.of(unit.params, self._eos_ids),
                    run=run,
                    index=i,
                    request_id=self.client.new_id(),
                )
                for i, unit in enumerate(job.units)
            ]
            self._runs.add(run)
            self._waiting += len(run.rows)
        for row in run.rows:
            message = submit_message(row.request_id, row.unit)
            try:
                self.client.submit(message, lambda m, row=row: self._on_message(row, m))
            except Exception as err:  # noqa: BLE001 - the engine is gone: this job fails, the server answers 500
                self._fail(run, err, "model_error")
                break
        return run

    def cancel(self, run: JobRun[_Row]) -> bool:
        """Drop a job that has no token yet (deadline passed, client gone): True; else False."""
        with self._cond:
            if run.done or run.admitted_at is not None:
                return False
            self._finish_run(run)
        self._abort(run)
        return True

    @property
    def kv_blocks(self) -> int:
        return self.client.info.kv_blocks

    @property
    def depth(self) -> int:
        return self._waiting

    @property
    def batch_limit(self) -> int:
        return self.max_running

    @property
    def alive(self) -> bool:
        return self.client.alive

    def retry_after_s(self) -> int:
        return self._retry_after(self._waiting / max(1, self.max_running) + 1)

    # -- the client's reader thread -------------------------------------------------------------
    def _on_message(self, row: _Row, message: Any) -> None:
        if isinstance(message, W.Failed):
            self._fail(row.run, RuntimeError(message.error), "model_error")
            return
        now = self._clock()
        for token in message.tokens:
            if row.done:
                break
            self._take_token(row, token, now)
        if message.finished is not None and not row.done:  # vLLM ended it first (its own end of sequence)
            if message.finished == "abort":
                self._fail(row.run, ClientGone("the request was aborted"), "cancelled")
                return
            piece = row.stream.end()
            row.unit.emit(piece.text)
            self._complete(row, now)

    def _take_token(self, row: _Row, token: int, now: float) -> None:
        unit = row.unit
        if row.last_token_at is None:
            self._admit(row, now)
        else:
            call_safely(self.hooks.on_token_gap, now - row.last_token_at)
        row.last_token_at = now
        self._sampled += 1
        piece = deliver(unit, row.stream, token, ends=row.stops.check(row.stream.tokens + 1, token), now=now)
        if piece.finished is not None:
            self.client.abort(row.request_id)  # accelab ended it (stop string, max_tokens): vLLM stops too
            self._complete(row, now)

    def _admit(self, row: _Row, now: float) -> None:
        run = row.run
        with self._cond:  # with _finish_run: a row stops counting as waiting exactly once
            if row.done:
                return
            row.last_token_at = now
            self._waiting -= 1
            run.admit(now)

    def _complete(self, row: _Row, now: float) -> None:
        run = row.run
        row.done = True
        with self._cond:
            if not run.complete(row.index, completion(row.unit, row.stream, finished_at=now, decode=self._decode)):
                return
            self._finish_run(run)
        self._note_seconds(run.finish(now, batch_units=len(run.rows)))

    def _on_stats(self, stats: Any) -> None:
        """One vLLM step: the continuous-batching metrics, in vLLM's own figures."""
        now = self._clock()
        report = _step_report(stats, self.client.info.kv_blocks, self._sampled, now - self._last_stats)
        self._sampled, self._last_stats = 0, now
        call_safely(self.hooks.on_step, report)

    # -- failing and sweeping -------------------------------------------------------------------
    def _finish_run(self, run: JobRun[_Row]) -> None:
        """Under the lock: the run leaves; its rows without a token stop counting as waiting."""
        run.done = True
        self._runs.discard(run)
        self._waiting -= sum(1 for row in run.rows if row.last_token_at is None and not row.done)
        for row in run.rows:
            row.done = True

    def _abort(self, run: JobRun[_Row]) -> None:
        for row in run.rows:
            self.client.abort(row.request_id)

    def _fail(self, run: JobRun[_Row], error: BaseException, kind: ErrorKind) -> None:
        with self._cond:
            if run.done:
                return
            self._finish_run(run)
        self._abort(run)
        run.failure(error, kind, self._clock())

    # the worker's thread sweeps: the runs whose client went away or whose deadline passed
    def _take(self) -> list[JobRun[_Row]] | None:
        now = self._clock()
        due = [run for run in self._runs if _cancelled(run) or _expired(run, now)]
        return due or None

    def _wait_s(self) -> float | None:
        return SWEEP_S

    def _drained(self) -> bool:
        return not self._runs

    def _run(self, runs: list[JobRun[_Row]]) -> None:
        now = self._clock()
        for run in runs:
            if _cancelled(run):
                self._fail(run, ClientGone("the client went away"), "cancelled")
            else:
                self._fail(run, deadline_error(now - run.arrival, run.job.timeout_s, "the engine's queue"), "timeout")


def _step_report(stats: W.Stats, kv_blocks: int, sampled: int, since_last_s: float) -> StepReport:
    """An engine step's stats (vLLM's own figures) as the metrics' StepReport; `sampled`: the tokens
    the worker received since the last one."""
    used = round(stats.kv_usage * kv_blocks)
    return StepReport(
        running=stats.running,
        waiting=stats.waiting,
        kv_used=used,
        kv_free=kv_blocks - used,
        tokens=0,
        sampled=sampled,
        preempted=stats.preempted,
        seconds=stats.seconds if stats.seconds is not None else since_last_s,
        reused_tokens=stats.prefix_hit_tokens,  # this step's (vLLM reports prefix-cache stats per update)
        batch=stats.running,
    )


def _cancelled(run: JobRun[_Row]) -> bool:
    return any(row.unit.cancelled for row in run.rows)


def _expired(run: JobRun[_Row], now: float) -> bool:
    return run.admitted_at is None and run.job.timeout_s is not None and now - run.arrival > run.job.timeout_s


def submit_message(request_id: str, unit: GenUnit) -> W.Submit:
    """A unit's prompt and sampling rules as vLLM takes them (its own sampler applies them); the seed
    of choice i of a request is seed + i, as on accelab's other engines."""
    p = unit.params
    seed = getattr(unit.sampler, "seed", p.seed)
    return W.Submit(
        id=request_id,
        prompt_ids=list(unit.prompt.ids),
        max_tokens=p.max_tokens,
        min_tokens=p.min_tokens,
        temperature=0.0 if p.greedy else p.temperature,  # accelab's rule: below SAMPLING_EPS is greedy
        top_p=max(p.top_p, SAMPLING_EPS),  # a top_p that rounds to 0 in float32 would keep nothing there
        seed=seed,
        ignore_eos=p.ignore_eos,
        top_k=p.top_k,
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        logit_bias=[[t, b] for t, b in p.logit_bias],
        stop_token_ids=list(p.stop_token_ids),
    )
