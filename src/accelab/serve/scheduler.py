"""The continuous-batching scheduler: which sequences run in the next decoding step, and
with which tokens. Pure logic: no torch, no threads, no I/O; the clock is injected.

Per step (`schedule`), in this order:
1. cancelled sequences leave, and their KV blocks are freed; waiting sequences past their
   deadline expire (the caller answers 504; they never ran);
2. every running sequence that is decoding gets its one token, oldest admission first. One
   that needs a new KV block when none is free preempts the youngest running sequence (maybe
   itself): its blocks are freed and it goes back to the head of the queue, to be recomputed
   (prompt and generated tokens) when it is admitted again;
3. sequences still prefilling get the next chunk of their tokens from what is left of the
   step's token budget, oldest first, so a long prompt never stalls the decodes for longer
   than one chunk; with `max_step_images`, a chunk also ends before an image whose encoding
   the step has no budget left for (a vision-language model's encoder runs there);
4. waiting sequences are admitted in arrival order while a slot is free, the budget has room
   and the KV cache can hold all their tokens. The head of the queue is never overtaken:
   short prompts cannot starve a long one. An admitted sequence whose first tokens the engine
   still holds from a finished one (`reuse`: a chat template and system prompt shared by every
   request) starts its prefill after them;
5. a step that gives a text prompt its first token leaves out the chunks over image positions
   (a vision-language model's image prompts): they go in the next step, never held twice in a row.
   The same rule, text first, times the image work between steps (`hold_image_work`): while a
   prompt the next step can prefill waits on no image, preparing new image requests and the
   encoder's slice wait for that step, never after two steps in a row.

Another choice of an n > 1 request starts once the first choice has prefilled the prompt and
picked its first token (`add_choice`): forked onto the first choice's blocks at once (prefix
caching), or queued, to fork the engine's state of it at admission (`reuse`).

After the engine ran the step, the caller reports each chunk with `advance` (and the token
sampled at its end). The scheduler decides there whether that token ends the sequence (its
`StopRules`: end of sequence, stop token ids, min_tokens, max_tokens) and says why; the caller
ends a sequence with `finish`, for that reason or its own (a stop string in the text, an error).

The KV cache is a `BlockPool` (`accelab.serve.kv_blocks`: reference counts, prefix caching,
copy-on-write): a sequence gets blocks for its whole prompt at admission and one more when a
decode crosses into a new block; with `prefix_caching` it first takes the cached blocks of its
longest prefix, and a fork (n > 1) shares its parent's. Shared blocks written into are copied
first (`Step.copies`, for the engine to run before the step's chunks).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from accelab.serve.batcher import QueueFull  # one "answer 429" for both schedulers
from accelab.serve.kv_blocks import BlockPool, CopyBlock, PoolFull
from accelab.serve.sequences import Chunk, Sequence, Step
from accelab.serve.stops import FinishReason, StopRules

T = TypeVar("T")

__all__ = ["NeverFits", "Scheduler", "SchedulerConfig"]


class NeverFits(ValueError):
    """A sequence that could not fit the KV cache even alone; the caller answers 413."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerConfig:
    max_running: int = 8  # sequences in the running batch (decoding or prefilling)
    max_step_tokens: int = 256  # tokens one step feeds the model: decodes + prefill chunks
    kv_blocks: int = 1024  # KV-cache capacity, in blocks
    block_size: int = 16  # tokens per block
    max_queue: int = 256  # sequences waiting; more get QueueFull
    prefix_caching: bool = False  # committed blocks are shared by later sequences (the engine keeps KV in them)
    max_step_images: int = 0  # images whose encoding a step's prefill chunks may start (0: no cap)

    def __post_init__(self) -> None:
        for name in ("max_running", "max_step_tokens", "kv_blocks", "block_size", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be 1 or more")
        if self.max_step_images < 0:
            raise ValueError(f"max_step_images={self.max_step_images} must be 0 (no cap) or more")
        if self.max_step_tokens <= self.max_running:
            raise ValueError(
                f"max_step_tokens={self.max_step_tokens} must be more than max_running={self.max_running}: every "
                "running sequence decodes one token per step, and prefill needs room beside them"
            )

    @property
    def kv_tokens(self) -> int:
        return self.kv_blocks * self.block_size


class Scheduler(Generic[T]):
    def __init__(
        self,
        config: SchedulerConfig,
        clock: Callable[[], float],
        reuse: Callable[[Sequence[T]], int] | None = None,
        release: Callable[[Sequence[T]], None] | None = None,
        ready: Callable[[Hashable], bool] | None = None,
    ):
        if reuse is not None and config.prefix_caching:
            raise ValueError("prefix_caching and an engine's own `reuse` are two prefix caches; choose one")
        self.config = config
        self._clock = clock
        self._reuse = reuse  # admitted sequence -> leading tokens whose KV the engine holds already
        # the engine's own state of a sequence that leaves (finished, dropped or preempted) goes
        # the moment its blocks do: a sequence admitted later in the same step may need it (a slot)
        self._release = release
        self._ready = ready  # image key -> its features are ready (the engine encodes ahead)
        self._encode: list[tuple[Sequence[T], Hashable]] = []  # the step's images to encode
        # text first: sequences whose image chunk the last step left out for a text prompt, and
        # whether the image work after the last step waited for one (`hold_image_work`)
        self._held: set[int] = set()
        self._work_held = self._held_before = False
        self._waiting: deque[Sequence[T]] = deque()
        self._running: list[Sequence[T]] = []  # in admission order
        self._cancelled: list[Sequence[T]] = []  # running ones, dropped at the next step
        self.pool = BlockPool(config.kv_blocks, config.block_size, prefix_caching=config.prefix_caching)
        self._copies: list[CopyBlock] = []  # copy-on-write of the step being scheduled
        self._images_left: int | None = None  # images the step being scheduled may still start encoding
        self._ids = itertools.count()
        self.preemptions = 0
        self.reused_tokens = 0  # prompt tokens not recomputed: prefix-cache hits (or the engine's `reuse`)

    # -- state ----------------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def free_blocks(self) -> int:
        return self.pool.free

    @property
    def used_blocks(self) -> int:
        return self.pool.used

    @property
    def cached_blocks(self) -> int:
        """Free blocks that still hold a prefix a later sequence may take."""
        return self.pool.cached

    @property
    def idle(self) -> bool:
        return not self._waiting and not self._running and not self._cancelled

    def sequences(self) -> list[Sequence[T]]:
        """Every sequence waiting or running."""
        return [*self._waiting, *self._running]

    def next_deadline(self) -> float | None:
        """The earliest deadline of a waiting sequence (when `schedule` must run to expire it)."""
        return min((s.deadline for s in self._waiting if s.deadline is not None), default=None)

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.config.block_size)

    # -- requests -------------------------------------------------------------------------
    def add(
        self,
        payload: T,
        prompt: tuple[int, ...],
        *,
        stops: StopRules,
        timeout_s: float | None = None,
        accepted: bool = False,
        cache_prompt: tuple[Hashable, ...] | None = None,
    ) -> Sequence[T]:
        """Queue a sequence that generates until `stops` end it. `accepted`: its request was
        admitted already (a later choice of an n > 1 request, counted against max_queue when the
        request came), so the bound does not refuse it now. `cache_prompt`: the prompt as the
        prefix cache keys it, where token ids alone do not say what a position holds (images)."""
        if cache_prompt is not None and len(cache_prompt) != len(prompt):
            raise ValueError(f"cache_prompt has {len(cache_prompt)} positions for a prompt of {len(prompt)}")
        if not prompt:
            raise ValueError("a sequence needs at least one prompt token")
        self.check_fits(len(prompt), stops.max_tokens)
        if not accepted and len(self._waiting) >= self.config.max_queue:
            raise QueueFull(f"{len(self._waiting)} sequences are waiting (max_queue={self.config.max_queue})")
        now = self._clock()
        seq = Sequence(
            id=next(self._ids),
            payload=payload,
            prompt=tuple(prompt),
            stops=stops,
            arrival=now,
            deadline=None if timeout_s is None else now + timeout_s,
            cache_prompt=cache_prompt,
        )
        self._waiting.append(seq)
        return seq

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        """NeverFits unless a sequence of this size fits the KV cache when alone (max_tokens >= 1:
        the request's SamplingParams checked it where the request was parsed)."""
        need = prompt_tokens + max_tokens - 1  # the last token is sampled, never fed back
        if need > self.config.kv_tokens:
            raise NeverFits(
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) needs {need} tokens of KV cache; the "
                f"whole cache holds {self.config.kv_tokens} (--kv-cache-tokens); lower max_tokens or shorten the prompt"
            )

    def cancel(self, seq: Sequence[T]) -> bool:
        """The client is gone. A waiting sequence leaves now (True); a running one leaves at the
        next step, which frees its blocks (False: it had started)."""
        if seq.state == "done" or seq.cancelled:
            return False
        seq.cancelled = True
        if seq.state == "waiting":
            self._waiting.remove(seq)
            seq.state = "done"
            return True
        self._cancelled.append(seq)
        return False

    def fork(self, parent: Sequence[T], payload: T, *, tokens: int | None = None) -> Sequence[T]:
        """Another choice of `parent`'s prompt (n > 1): a running sequence with the same prompt
        that shares the parent's blocks of its first `tokens` positions (by default all but the
        prompt's last, whose logits the child needs for its own first token) and prefills the
        rest itself. The first write into a shared block copies it (Step.copies)."""
        if parent.state != "running" or parent.cancelled:
            raise ValueError(f"sequence {parent.id} is {parent.state}: only a running sequence can be forked")
        n = len(parent.prompt) - 1 if tokens is None else tokens
        if not 0 <= n <= min(parent.computed, len(parent.prompt) - 1):
            raise ValueError(
                f"a fork shares 0 to {min(parent.computed, len(parent.prompt) - 1)} positions of sequence "
                f"{parent.id} (its computed prompt, less the last token); got {n}"
            )
        if len(self._running) >= self.config.max_running:
            raise QueueFull(
                f"{len(self._running)} sequences are running (max_running={self.config.max_running}): "
                "no slot for another choice"
            )
        shared = self.blocks_for(n)
        child = Sequence(
            id=next(self._ids),
            payload=payload,
            prompt=parent.prompt,
            cache_prompt=parent.cache_prompt,
            stops=parent.stops,
            arrival=parent.arrival,
            deadline=None,
            computed=n,
            state="running",
            admitted_at=self._clock(),
            block_table=self.pool.fork(parent.block_table[:shared]),
            block_keys=list(parent.block_keys[: n // self.config.block_size]),
        )
        try:
            child.block_table += [self.pool.allocate() for _ in range(self.blocks_for(child.length) - shared)]
        except PoolFull:
            self.pool.release(child.block_table)
            raise QueueFull(f"the KV cache has no room for another choice of sequence {parent.id}") from None
        self._running.append(child)
        self.reused_tokens += n  # the shared prompt positions are not computed again
        return child

    def add_choice(self, parent: Sequence[T], payload: T) -> Sequence[T]:
        """Another choice of `parent`'s prompt (n > 1), once `parent` prefilled it and picked its
        first token. With prefix caching (the engine keeps KV in the pool's blocks) it forks
        `parent`'s blocks and runs now, or, with no slot or block free, queues and finds them in the
        prefix cache; otherwise it queues, and at admission the engine's `reuse` forks `parent`'s
        state (`Sequence.forked_from`). Counted against max_queue when its request came: never
        refused for the queue now."""
        if self.config.prefix_caching and parent.state == "running":
            with contextlib.suppress(QueueFull):
                return self.fork(parent, payload)
        child = self.add(payload, parent.prompt, stops=parent.stops, accepted=True, cache_prompt=parent.cache_prompt)
        child.forked_from = parent
        return child

    # -- the step -------------------------------------------------------------------------
    def schedule(self) -> Step[T]:
        dropped = self._drop_cancelled()
        expired = self._expire()
        budget = self.config.max_step_tokens
        self._images_left = self.config.max_step_images or None
        self._encode = []
        chunks: list[Chunk[T]] = []
        preempted: list[Sequence[T]] = []
        self._copies = []

        # 2. decodes: one token each, oldest first; growth may preempt the youngest
        for seq in list(self._running):
            if seq.state != "running" or not seq.decoding:
                continue
            if self._reserve(seq, seq.computed + 1, preempted):
                chunks.append(Chunk(seq=seq, start=seq.computed, tokens=seq.token_slice(seq.computed, seq.length)))
                budget -= 1

        # 3. prefill chunks of running sequences (their blocks were reserved at admission; a
        # fork's first chunk writes into a block it shares: copied first)
        for seq in list(self._running):
            if budget <= 0:
                break
            if seq.state == "running" and not seq.decoding and seq.pending > 0:
                chunk = self._chunk(seq, budget)
                if chunk is not None and self._reserve(seq, chunk.start + len(chunk.tokens), preempted):
                    chunks.append(chunk)
                    budget -= len(chunk.tokens)

        # 4. admission, in arrival order, never past the head
        admitted: list[Sequence[T]] = []
        while budget > 0 and self._waiting and len(self._running) < self.config.max_running:
            seq = self._waiting[0]
            if not self._allocate(seq):
                break
            self._waiting.popleft()
            seq.state, seq.deadline = "running", None  # admitted: no queue deadline any more
            if seq.admitted_at is None:
                seq.admitted_at = self._clock()
                admitted.append(seq)
            self._running.append(seq)
            chunk = self._chunk(seq, budget)
            if chunk is None:  # its first image is not encoded yet, or the step has no budget for it
                continue
            if not self._reserve(seq, chunk.start + len(chunk.tokens), preempted):  # `_allocate` left room
                raise AssertionError(f"sequence {seq.id} was admitted without the blocks its first chunk needs")
            chunks.append(chunk)
            budget -= len(chunk.tokens)
        chunks = [c for c in chunks if c.seq.state == "running"]  # a later preemption may void an earlier chunk
        chunks = self._text_first(chunks)
        return Step(
            chunks=chunks,
            admitted=admitted,
            expired=expired,
            dropped=dropped,
            preempted=preempted,
            copies=self._copies,
            encode=[(seq, key) for seq, key in self._encode if seq.state == "running"],
        )

    def advance(self, chunk: Chunk[T], token: int | None) -> FinishReason | None:
        """The engine computed `chunk` (and sampled `token` at its end when `chunk.sample`).
        Returns why that token ends the sequence ("stop" or "length"), None while it goes on;
        the caller then `finish`es it."""
        seq = chunk.seq
        if seq.state != "running" or seq.computed != chunk.start:
            return None  # preempted or cancelled meanwhile: the chunk's work is void
        if chunk.sample and token is None:
            raise ValueError(f"chunk of sequence {seq.id} ends at its last token: it needs the sampled token")
        seq.computed += len(chunk.tokens)
        if chunk.sample and token is not None:
            seq.generated.append(token)
            seq.finish_reason = seq.stops.check(len(seq.generated), token)
        self._commit(seq)
        return seq.finish_reason

    def finish(self, seq: Sequence[T]) -> None:
        """The sequence is complete (or failed): it leaves and frees its blocks."""
        if seq in self._running:
            self._running.remove(seq)
        elif seq in self._waiting:
            self._waiting.remove(seq)
        if seq in self._cancelled:
            self._cancelled.remove(seq)
        self._free(seq)
        seq.state = "done"

    # -- text first: a text prompt's first token before image work -----------------------------
    def first_token_due(self) -> bool:
        """A prompt the next step can prefill waits on no image: its first token comes before the
        encoder's next full slice (text requests beside a stream of new images start sooner). One
        that waits for room in a full running batch does not count. False without an encoder."""
        ready = self._ready
        if ready is None:
            return False
        room = len(self._running) < self.config.max_running
        return any(
            seq.computed < len(seq.prompt)
            and (room or seq.state == "running")
            and all(ready(seq.image_key(start)) for start in seq.image_starts(seq.computed, len(seq.prompt)))
            for seq in self.sequences()
        )

    def hold_image_work(self, *, again: bool = False) -> bool:
        """After a step ran: whether the image work (preparing requests with images, the encoder's
        slice) waits for the step that gives a text prompt its first token (`first_token_due`);
        never after two steps in a row. `again`: asked once more after the same step (requests
        joined meanwhile)."""
        if not again:
            self._held_before, self._work_held = self._work_held, False
        if self._held_before or not self.first_token_due():
            return False
        self._work_held = True
        return True

    # -- internals ------------------------------------------------------------------------
    def _text_first(self, chunks: list[Chunk[T]]) -> list[Chunk[T]]:
        """A step that gives a text prompt (no image) its first token leaves out the prefill
        chunks over image positions: the next step has them (a sequence is left out once in a
        row at most). Each prompt token costs the step time (SmolVLM-256M on 2 cores: ~0.5 ms),
        and one image brings ~70 to hundreds of them: beside two images, a text prompt's first
        token took 82 ms instead of 24."""
        held, self._held = self._held, set()
        if not any(c.sample and c.start < len(c.seq.prompt) and not c.seq.has_images for c in chunks):
            return chunks
        kept = []
        for chunk in chunks:
            seq = chunk.seq
            if seq.id not in held and seq.holds_images(chunk.start, chunk.start + len(chunk.tokens)):
                self._held.add(seq.id)
                continue
            kept.append(chunk)
        return kept

    def _chunk(self, seq: Sequence[T], budget: int) -> Chunk[T] | None:
        """The next prefill chunk of `seq` within `budget` tokens; it ends before an image the
        step has no encoder budget for, or whose features are not ready (None: it would be empty)."""
        end = seq.computed + min(seq.pending, budget)
        if self._ready is not None:
            for start in seq.image_starts(seq.computed, seq.length):
                key = seq.image_key(start)
                if not self._ready(key):
                    self._encode.append((seq, key))
                    end = min(end, start)
                    break
        if self._images_left is not None:
            starts = seq.image_starts(seq.computed, end)
            if len(starts) > self._images_left:
                end = starts[self._images_left]
            self._images_left -= min(len(starts), self._images_left)
        if end <= seq.computed:
            return None
        return Chunk(seq=seq, start=seq.computed, tokens=seq.token_slice(seq.computed, end))

    def _drop_cancelled(self) -> list[Sequence[T]]:
        dropped = [s for s in self._cancelled if s.state != "done"]
        for seq in dropped:
            self.finish(seq)
        self._cancelled.clear()
        return dropped

    def _expire(self) -> list[Sequence[T]]:
        now = self._clock()
        expired = [s for s in self._waiting if s.deadline is not None and s.deadline <= now]
        for seq in expired:
            self._waiting.remove(seq)
            seq.state = "done"
        return expired

    def _allocate(self, seq: Sequence[T]) -> bool:
        """Blocks for all of a waiting sequence's tokens: the cached blocks of its longest
        prefix (prefix caching), or what the engine's `reuse` holds, then fresh ones; False
        (nothing taken) when the pool is short."""
        hits = self.pool.match(seq.cache_slice(0, seq.length))
        fresh = self.blocks_for(seq.length) - len(hits)
        size = self.config.block_size
        # a prompt of whole cached blocks feeds its last token again, into the last hit: a copy
        # of it when another sequence holds it too
        copy = int(bool(hits) and len(hits) * size >= seq.length and self.pool.refs(hits[-1]) > 0)
        if fresh + copy + sum(1 for b in hits if self.pool.refs(b) == 0) > self.pool.free:
            return False
        for block in hits:
            self.pool.take(block)
        seq.block_table = hits + [self.pool.allocate() for _ in range(fresh)]
        if hits:  # at least the last token is fed: its logits pick the next
            seq.computed = min(len(hits) * size, seq.length - 1)
            seq.block_keys = [self.pool.committed_key(b) for b in hits[: seq.computed // size]]
            self.pool.hits += len(hits)
        elif self._reuse is not None:
            seq.computed = max(0, min(self._reuse(seq), seq.length - 1))
        self.reused_tokens += seq.computed
        return True

    def _reserve(self, seq: Sequence[T], end: int, preempted: list[Sequence[T]]) -> bool:
        """Blocks for positions < `end`, those from `seq.computed` on private to `seq` (a shared
        one is copied: Step.copies); preempts the youngest while the pool is short. False when
        `seq` itself was preempted."""
        size = self.config.block_size
        while seq.state == "running":
            try:
                while len(seq.block_table) < self.blocks_for(end):
                    seq.block_table.append(self.pool.allocate())
                first = seq.computed // size
                del seq.block_keys[first:]  # blocks about to change are no longer the cached prefix
                for index in range(first, self.blocks_for(end)):
                    copy = self.pool.writable(seq.block_table, index)
                    if copy is not None:
                        self._copies.append(copy)
                return True
            except PoolFull:
                preempted.append(self._preempt_youngest())
        return False

    def _commit(self, seq: Sequence[T]) -> None:
        """Register the blocks `seq` has just filled, for later sequences with the same prefix."""
        size = self.config.block_size
        while len(seq.block_keys) < seq.computed // size:
            index = len(seq.block_keys)
            parent = seq.block_keys[-1] if seq.block_keys else None
            seq.block_keys.append(
                self.pool.commit(seq.block_table[index], parent, seq.cache_slice(index * size, (index + 1) * size))
            )

    def _preempt_youngest(self) -> Sequence[T]:
        victim = self._running.pop()
        self._copies = [c for c in self._copies if c.dst not in victim.block_table]
        self._free(victim)
        victim.state, victim.computed = "waiting", 0
        victim.preemptions += 1
        self.preemptions += 1
        # ahead of every sequence that arrived after it: it keeps its place in line
        index = next((i for i, s in enumerate(self._waiting) if s.arrival > victim.arrival), len(self._waiting))
        self._waiting.insert(index, victim)
        return victim

    def _free(self, seq: Sequence[T]) -> None:
        self.pool.release(seq.block_table)
        seq.block_table, seq.block_keys = [], []
        if self._release is not None:
            self._release(seq)
