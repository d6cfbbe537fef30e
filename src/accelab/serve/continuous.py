"""The continuous-batching worker: one thread owns the step engine and runs the scheduler's
steps back to back while there is work, so requests join and leave the running batch at
every decoding step and tokens stream as they are made (the static `Worker` runs one
`generate` per batch instead).

It takes the same `Job`s as the static worker, so the routes do not care which one runs
them: a job's units (`GenUnit`, one per prompt) become sequences of the pure `Scheduler`,
which decides when a token ends one (`StopRules`); the row's `TextStream` turns the tokens
into text and ends it early on a stop string.
Every job gets exactly one `done` call, from this thread:
- its completions, once all its sequences finished (end of sequence, stop string, max_tokens);
- a timeout when it waited past its deadline without being admitted (never run);
- a model error when the engine failed on one of its sequences: a failed step is retried
  sequence by sequence, so only the sequences that fail alone fail, and only their jobs;
- "cancelled" when its client went away (the route set `unit.cancelled`): its sequences
  leave at the next step and their KV-cache entries are freed.

n > 1 choices of one prompt: the first choice is queued alone; once it has prefilled the
prompt and picked its first token, the others start from its KV of the prompt, so the prompt is
prefilled once. On a paged engine (prefix caching) each runs at once on the first choice's
blocks (`Scheduler.fork`: shared, the partial last block copied on write), or queues and finds
them in the prefix cache when no slot or block is free; on an engine that keeps state per
sequence (llama.cpp) each queues, and at admission `engine.fork` copies the first choice's KV of
the prompt less its last token (fed again: its logits pick the choice's first token). Echo's
prompt log-probabilities come from one `engine.score` of the prompt at admission.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field, replace
from typing import Any

from accelab.serve.batcher import QueueFull
from accelab.serve.engines.base import (
    ContinuousHooks,
    CostsSteps,
    EncodesAhead,
    GenUnit,
    PagedKV,
    PayloadTooLarge,
    StepEngine,
    StepInput,
    StepReport,
    SupportsFork,
    SupportsPrefixReuse,
    SupportsScore,
)
from accelab.serve.engines.delivery import completion, deliver
from accelab.serve.jobs import (
    ClientGone,
    ErrorKind,
    Job,
    JobRun,
    WorkerThread,
    call_safely,
    deadline_error,
    error_kind,
    is_out_of_memory,
)
from accelab.serve.runner.logprobs import prompt_logprobs
from accelab.serve.runner.sampling import SampledToken
from accelab.serve.runner.vision import prompt_keys
from accelab.serve.scheduler import NeverFits, Scheduler, SchedulerConfig
from accelab.serve.sequences import Chunk, Sequence, Step
from accelab.serve.stops import FinishReason, StopRules
from accelab.serve.textstream import TextStream, stream_for

log = logging.getLogger(__name__)

__all__ = ["ClientGone", "ContinuousWorker"]


@dataclass(kw_only=True, slots=True, eq=False)
class _Row:
    unit: GenUnit
    stream: TextStream
    run: JobRun[_Row]
    index: int
    seq: Sequence[_Row] | None = None
    last_token_at: float | None = None
    children: list[_Row] = field(default_factory=list)  # the other choices (n > 1), queued after its prefill


class ContinuousWorker(WorkerThread[Step[_Row]]):
    def __init__(
        self,
        engine: StepEngine,
        config: SchedulerConfig,
        *,
        decode: Callable[[Seq[int]], str],
        eos_ids: Seq[int],
        clock: Callable[[], float] = time.monotonic,
        hooks: ContinuousHooks | None = None,
        encoder_share: float = 1.0,
        encoder_batch: int = 1,
    ):
        super().__init__("accelab-continuous-worker", clock=clock)
        self._encoder_share = encoder_share  # the vision encoder's time after a step, in that step's time
        self._encoder_batch = encoder_batch  # images the vision encoder takes in one forward, at most
        self.engine = engine
        self.config = config
        self._decode = decode
        self._eos_ids = tuple(eos_ids)
        # what the engine can do besides stepping (engines.base): asked once, here
        self._reuse = engine if isinstance(engine, SupportsPrefixReuse) else None
        self._fork = engine if isinstance(engine, SupportsFork) else None
        self._paged = engine if isinstance(engine, PagedKV) else None
        self._costs = engine if isinstance(engine, CostsSteps) else None
        self._encoder = engine if isinstance(engine, EncodesAhead) and engine.encodes_ahead else None
        if self._encoder is not None:  # images are encoded between the steps, not in them
            config = replace(config, max_step_images=0)
            self.config = config
        if self._paged is not None:  # its KV lives in the pool's blocks: the pool's prefix cache is real
            config = replace(config, prefix_caching=True)
            self.config = config
        wants_reuse = (self._reuse or self._fork) and not config.prefix_caching
        self._scheduler: Scheduler[_Row] = Scheduler(
            config,
            clock,
            reuse=self._reused if wants_reuse else None,
            release=lambda seq: engine.release(seq.id),
            ready=self._encoder.image_ready if self._encoder is not None else None,
        )
        self._block_bytes = engine.kv_bytes_per_token * config.block_size
        self._reused_seen = 0
        self.hooks = hooks or ContinuousHooks()

    # -- called from the event loop -------------------------------------------------------
    def submit(self, job: Job) -> JobRun[_Row]:
        """Queue a job's sequences; raises QueueFull (429), ShuttingDown (503) or
        PayloadTooLarge (413: it could not fit the KV cache even alone)."""
        run: JobRun[_Row] = JobRun(job=job, arrival=self._clock())
        run.rows = [
            _Row(unit=unit, stream=stream_for(unit.params, self._decode), run=run, index=i)
            for i, unit in enumerate(job.units)
        ]
        parents = {id(row.unit): row for row in run.rows}
        for row in run.rows:
            if row.unit.fork_of is not None and id(row.unit.fork_of) in parents:
                parents[id(row.unit.fork_of)].children.append(row)
        with self._cond:
            self._accepting()
            try:
                for unit in job.units:
                    self._scheduler.check_fits(len(unit.prompt.ids), unit.params.max_tokens)
            except NeverFits as err:
                raise PayloadTooLarge(str(err)) from None
            if self._scheduler.waiting + len(run.rows) > self.config.max_queue:  # all of the job or none
                raise QueueFull(f"{self._scheduler.waiting} sequences are waiting (max_queue={self.config.max_queue})")
            forked = {id(child) for row in run.rows for child in row.children}
            for row in run.rows:
                if id(row) not in forked:  # the other choices are queued once their parent prefilled
                    row.seq = self._scheduler.add(
                        row,
                        row.unit.prompt.ids,
                        stops=self._stops(row.unit),
                        timeout_s=job.timeout_s,
                        cache_prompt=prompt_keys(row.unit.prompt),
                    )
            self._cond.notify()
        return run

    def cancel(self, run: JobRun[_Row]) -> bool:
        """Take a job out of the queue (deadline passed, client gone) if none of its sequences
        was admitted yet (True); False once it runs (then it is answered as usual)."""
        with self._cond:
            if run.done or run.admitted_at is not None:
                return False
            for row in run.rows:
                if row.seq is not None:
                    self._scheduler.cancel(row.seq)
            run.done = True
        return True

    @property
    def depth(self) -> int:
        with self._cond:
            return self._scheduler.waiting

    @property
    def batch_limit(self) -> int:
        return self.config.max_running

    def retry_after_s(self) -> int:
        """Seconds a client turned away should wait: the queue ahead of it, run max_running at a time."""
        with self._cond:
            rounds = self._scheduler.waiting / self.config.max_running + 1
        return self._retry_after(rounds)

    def _stops(self, unit: GenUnit) -> StopRules:
        return StopRules.of(unit.params, self._eos_ids)

    # -- the worker thread ----------------------------------------------------------------
    def _take(self) -> Step[_Row] | None:
        step = self._next_step()
        return None if step.empty else step

    def _drained(self) -> bool:
        return self._scheduler.idle

    def _next_step(self) -> Step[_Row]:
        """Under the lock: cancel what the routes gave up on, then schedule. A fault while
        scheduling (a bug) fails the requests the scheduler holds, with the error, and the
        worker goes on: the next request finds a working server."""
        try:
            for seq in self._scheduler.sequences():
                if seq.payload.unit.cancelled and not seq.cancelled:
                    self._scheduler.cancel(seq)
                    if seq.state == "done":  # it was waiting: answer its job now
                        self._fail(seq.payload.run, ClientGone("the client went away"), "cancelled")
            return self._scheduler.schedule()
        except Exception as err:  # the worker thread must survive anything
            held = self._scheduler.sequences()
            log.exception("continuous scheduler error: failing the %d sequences it held", len(held))
            for seq in held:
                self._scheduler.finish(seq)
                self._fail(seq.payload.run, err, "model_error")
            return Step()

    def _wait_s(self) -> float | None:
        deadline = self._scheduler.next_deadline()
        return None if deadline is None else max(0.0, deadline - self._clock())

    def _run(self, step: Step[_Row]) -> None:
        self._settle(step)
        started = self._clock()
        if step.copies:  # copy-on-write of shared blocks, before any chunk writes into them
            assert self._paged is not None, "only a paged engine's blocks are shared"
            self._paged.copy_blocks(step.copies)
        results = self._compute(step.chunks) if step.chunks else []
        now = self._clock()
        sampled = 0
        for chunk, result in zip(step.chunks, results):
            row = chunk.seq.payload
            if isinstance(result, BaseException):
                with self._cond:
                    self._scheduler.finish(chunk.seq)
                self._fail(row.run, result, error_kind(result))
                continue
            with self._cond:
                ends = self._scheduler.advance(chunk, None if result is None else result.token)
            if result is not None and chunk.seq.state == "running" and not chunk.seq.cancelled:
                sampled += 1
                self._take_token(row, result, ends, now)
        call_safely(self.hooks.on_step, self._report(step, sampled=sampled, seconds=now - started))
        if self._encoder is not None and self._hold_image_work():  # text first (the scheduler's rule)
            return
        self._do_chores()  # requests with images prepared now join the queue while the encoder runs
        if step.encode and not self._hold_image_work(again=True):
            self._encode_images(step, seconds=now - started)

    def _hold_image_work(self, *, again: bool = False) -> bool:
        with self._cond:
            return self._scheduler.hold_image_work(again=again)

    def _encode_images(self, step: Step[_Row], *, seconds: float) -> None:
        """The encoder's slice after a step: `encoder_share` times as long as the step took (the
        encoder and the running sequences share the machine), the whole of the images when
        nothing else ran. A request whose image failed to encode fails alone."""
        assert self._encoder is not None
        wanted = [
            (seq, image)
            for seq, key in step.encode
            if seq.state == "running"  # one that left meanwhile must not hold the features
            for image in seq.payload.unit.prompt.media
            if image.key == key
        ]
        if not wanted:
            return
        budget = self._encoder_share * seconds if step.chunks else None
        failed = self._encoder.encode_ahead(
            [(seq.id, image) for seq, image in wanted],
            budget,
            batch=self._encoder_batch,
            interrupt=self._first_token_due,  # half a layer at least, then the step that prefills it
        )
        for seq, image in wanted:
            error = failed.get(image.key)
            if error is not None and seq.state != "done":
                with self._cond:
                    self._scheduler.finish(seq)
                self._fail(seq.payload.run, error, error_kind(error))

    @property
    def encodes_images(self) -> bool:
        """Its engine runs the vision encoder between the steps (a vision-language model)."""
        return self._encoder is not None

    def _chores_wait(self) -> bool:
        return self._encoder is not None and self._first_token_due()

    def _first_token_due(self) -> bool:
        with self._cond:
            return self._scheduler.first_token_due()

    def _settle(self, step: Step[_Row]) -> None:
        """Before the step runs: answer the jobs that expired or were dropped, and start the
        admitted ones (echo's prompt scoring)."""
        for seq in step.expired:
            run = seq.payload.run
            self._fail(run, deadline_error(self._clock() - seq.arrival, run.job.timeout_s), "timeout")
        for seq in step.dropped:
            self._fail(seq.payload.run, ClientGone("the client went away"), "cancelled")
        for seq in step.admitted:
            run = seq.payload.run
            run.admit(self._clock())
            try:
                self._score_prompt(seq.payload)
            except Exception as err:  # noqa: BLE001 - this job fails alone
                log.warning("scoring a prompt failed: %r", err)
                self._fail(run, err, error_kind(err))

    def _report(self, step: Step[_Row], *, sampled: int, seconds: float) -> StepReport:
        cost = self._costs.step_cost(step.chunks) if self._costs is not None and step.chunks else None
        encoder_cache = getattr(self.engine, "encoder_cache", None)
        with self._cond:
            reused, self._reused_seen = self._scheduler.reused_tokens - self._reused_seen, self._scheduler.reused_tokens
            return StepReport(
                running=self._scheduler.running,
                waiting=self._scheduler.waiting,
                kv_used=self._scheduler.used_blocks,
                kv_free=self._scheduler.free_blocks,
                kv_cached=self._scheduler.cached_blocks,
                kv_block_bytes=self._block_bytes,
                tokens=step.tokens,
                sampled=sampled,
                preempted=len(step.preempted),
                seconds=seconds,
                reused_tokens=reused,
                batch=len(step.chunks),
                preempted_tokens=sum(seq.length for seq in step.preempted),
                cost=cost,
                images=encoder_cache.take_counts() if encoder_cache is not None else None,
            )

    def _compute(self, chunks: list[Chunk[_Row]]) -> Seq[SampledToken | None | BaseException]:
        """The engine's step over `chunks`: a token (sampling chunks), None (the others) or the
        error of a chunk that failed alone."""
        inputs = [
            StepInput(
                seq_id=c.seq.id,
                start=c.start,
                tokens=c.tokens,
                sample=c.sample,
                params=c.seq.payload.unit.params,
                sampler=c.seq.payload.unit.sampler,
                blocks=tuple(c.seq.block_table),
                images=c.seq.payload.unit.prompt.media if c.start < len(c.seq.prompt) else (),
            )
            for c in chunks
        ]
        try:
            return _spread(inputs, self.engine.step(inputs))
        except Exception as err:  # noqa: BLE001 - answered per sequence below
            if len(inputs) == 1:
                log.warning("a sequence failed: %r", err)
                return [err]
            log.warning("a step of %d sequences failed (%r); running them one by one", len(inputs), err)
            call_safely(self.hooks.on_retry, "oom" if is_out_of_memory(err) else "batch_error")
        results: list[SampledToken | None | BaseException] = []
        for item in inputs:
            try:
                results.extend(_spread([item], self.engine.step([item])))
            except Exception as err:  # noqa: BLE001 - this sequence fails alone, the others go on
                log.warning("a sequence failed: %r", err)
                results.append(err)
        return results

    def _take_token(self, row: _Row, sampled: SampledToken, ends: FinishReason | None, now: float) -> None:
        """A row's new token, with the scheduler's verdict on it: its text goes out, and the row
        finishes on that verdict or on a stop string its text stream found."""
        if row.last_token_at is not None:
            call_safely(self.hooks.on_token_gap, now - row.last_token_at)
        row.last_token_at = now
        piece = deliver(row.unit, row.stream, sampled.token, ends=ends, now=now, sampled=sampled)
        if row.children and row.stream.tokens == 1:  # the prompt is prefilled: the other choices may start
            self._queue_children(row)
        if piece.finished is None:
            return
        assert row.seq is not None
        with self._cond:
            self._scheduler.finish(row.seq)
        run = row.run
        answer = completion(row.unit, row.stream, finished_at=now, decode=self._decode, finish_reason=piece.finished)
        if run.complete(row.index, answer):
            self._note_seconds(run.finish(now, batch_units=self._scheduler.running + 1))

    def _queue_children(self, row: _Row) -> None:
        """The other choices of `row`'s prompt join the queue; admitted, each forks row's KV."""
        assert row.seq is not None
        with self._cond:
            for child in row.children:
                if not (child.unit.cancelled or child.run.done):
                    child.unit.prompt_sampled = row.unit.prompt_sampled
                    child.seq = self._scheduler.add_choice(row.seq, child)  # runs now, or queues
        row.children = []

    def _reused(self, seq: Sequence[_Row]) -> int:
        """Under the lock, at admission: leading tokens of `seq` whose KV the engine holds already
        (the parent choice's prompt, or a finished sequence's prefix)."""
        parent, seq.forked_from = seq.forked_from, None
        if parent is not None and parent.state == "running" and self._fork is not None:
            n = len(seq.prompt) - 1  # the last prompt token is fed again: its logits pick this choice's first
            if n > 0:
                self._fork.fork(parent.id, seq.id, n)
                return n
        return self._reuse.reuse_prefix(seq.id, seq.token_slice(0, seq.length)) if self._reuse is not None else 0

    def _score_prompt(self, row: _Row) -> None:
        """Echo: the log-probability of every prompt token, from one forward of the prompt."""
        top = row.unit.params.prompt_logprobs
        if top is None or row.unit.prompt_sampled is not None:
            return
        if not isinstance(self.engine, SupportsScore):
            raise RuntimeError(f"{self.engine.name} cannot score prompts (echo with logprobs)")
        if row.unit.prompt.media:
            raise ValueError("prompt log-probabilities (echo with logprobs) need a text prompt, not images")
        ids = row.unit.prompt.ids
        row.unit.prompt_sampled = prompt_logprobs(self.engine.score(ids), ids, top)

    def _fail(self, run: JobRun[_Row], error: BaseException, kind: ErrorKind) -> None:
        """Answer a job with `error` once; its other sequences stop at the next step."""
        if run.done:
            return
        for row in run.rows:
            row.unit.cancelled = True
            if row.seq is not None and row.seq.state != "done":
                with self._cond:
                    self._scheduler.cancel(row.seq)
        run.failure(error, kind, self._clock())


def _spread(inputs: list[StepInput], tokens: list[Any]) -> list[SampledToken | None]:
    """The engine's tokens (one SampledToken, or a bare id, per sampling input) laid out one per input."""
    wanted = sum(item.sample for item in inputs)
    if len(tokens) != wanted:
        raise RuntimeError(f"the engine returned {len(tokens)} tokens for {wanted} sampling sequences")
    picked = iter(SampledToken(token=t) if isinstance(t, int) else t for t in tokens)
    return [next(picked) if item.sample else None for item in inputs]
