"""A sequence as the continuous scheduler holds it, and what one of its steps hands the engine.

A `Sequence` is one prompt being generated: its tokens (prompt, then generated), how many of
them have their KV in the engine's cache (`computed`), the KV blocks that hold them, its state
(waiting, running, done) and the `StopRules` that end it. A `Step` is what the scheduler decided
for one engine call: the `Chunk`s to feed (a decode's one token, or a piece of a prefill), and
the sequences that were admitted, expired, dropped or preempted on the way, with the KV blocks to
copy first. Pure data; the policy that fills them is `accelab.serve.scheduler`.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

from accelab.serve.kv_blocks import CopyBlock
from accelab.serve.stops import FinishReason, StopRules

T = TypeVar("T")

SeqState = Literal["waiting", "running", "done"]

__all__ = ["Chunk", "SeqState", "Sequence", "Step"]


@dataclass(kw_only=True, slots=True, eq=False)
class Sequence(Generic[T]):
    """One sequence to generate. `computed` tokens have their KV in the engine's cache; the
    ones after it are fed in the next chunks."""

    id: int
    payload: T
    prompt: tuple[int, ...]
    stops: StopRules
    arrival: float
    deadline: float | None  # absolute, on the scheduler's clock; only while waiting
    generated: list[int] = field(default_factory=list)
    computed: int = 0
    block_table: list[int] = field(default_factory=list)  # the pool's blocks holding positions 0, 16, 32, ...
    block_keys: list[int] = field(default_factory=list)  # prefix-cache keys of its committed (full) blocks
    state: SeqState = "waiting"
    admitted_at: float | None = None  # the first admission
    cancelled: bool = False
    preemptions: int = 0
    finish_reason: FinishReason | None = None  # set by `advance` on the token that ends it
    # another choice (n > 1) queued on an engine that keeps state per sequence (llama.cpp): the
    # choice whose KV it takes at admission (the engine's `reuse` forks it); cleared then
    forked_from: Sequence[T] | None = None
    # the prompt as the prefix cache keys it, where it holds more than token ids (an image's
    # positions carry the image's content key: runner.vision.cache_prompt); None: the prompt
    cache_prompt: tuple[Hashable, ...] | None = None
    # the first position of each of the prompt's images, found once (the scheduler asks every step)
    _image_firsts: tuple[int, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        keyed = self.cache_prompt
        if keyed is not None:
            self._image_firsts = tuple(p for p, key in enumerate(keyed) if _image_row(key) == 0)

    @property
    def max_tokens(self) -> int:
        return self.stops.max_tokens

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.generated)

    @property
    def blocks(self) -> int:
        return len(self.block_table)

    @property
    def pending(self) -> int:
        """Tokens known but not yet fed to the model."""
        return self.length - self.computed

    @property
    def decoding(self) -> bool:
        return self.state == "running" and self.pending == 1 and bool(self.generated)

    def token_slice(self, start: int, stop: int) -> tuple[int, ...]:
        n = len(self.prompt)
        if stop <= n:
            return self.prompt[start:stop]
        return self.prompt[start:] + tuple(self.generated[max(0, start - n) : stop - n])

    def image_starts(self, start: int, stop: int) -> list[int]:
        """The first positions of the prompt's images in start..stop (the encoder runs there)."""
        firsts = self._image_firsts
        return list(firsts[bisect.bisect_left(firsts, start) : bisect.bisect_left(firsts, stop)])

    @property
    def has_images(self) -> bool:
        return bool(self._image_firsts)

    def holds_images(self, start: int, stop: int) -> bool:
        """Some prompt position in start..stop is an image's (its features, not a token's embedding)."""
        keyed = self.cache_prompt
        return keyed is not None and any(isinstance(key, tuple) for key in keyed[start:stop])

    def image_key(self, position: int) -> Hashable:
        """The content key of the image whose features fill `position` (an image position)."""
        assert self.cache_prompt is not None
        keyed = self.cache_prompt[position]
        assert isinstance(keyed, tuple), f"position {position} holds a token, not an image"
        return keyed[0]

    def cache_slice(self, start: int, stop: int) -> tuple[Hashable, ...]:
        """Positions start..stop as the prefix cache keys them (`cache_prompt`)."""
        if self.cache_prompt is None:
            return self.token_slice(start, stop)
        n = len(self.cache_prompt)
        if stop <= n:
            return self.cache_prompt[start:stop]
        return self.cache_prompt[start:] + tuple(self.generated[max(0, start - n) : stop - n])


def _image_row(position: Hashable) -> int | None:
    """The feature row an image position holds ((image key, row)); None for a token id."""
    return position[1] if isinstance(position, tuple) else None


@dataclass(frozen=True, kw_only=True, slots=True)
class Chunk(Generic[T]):
    """Tokens `start ..` of one sequence, fed to the model in this step. When the chunk ends at
    the last known token (`sample`), the engine picks the sequence's next token."""

    seq: Sequence[T]
    start: int
    tokens: tuple[int, ...]

    @property
    def sample(self) -> bool:
        return self.start + len(self.tokens) == self.seq.length


@dataclass(frozen=True, kw_only=True, slots=True)
class Step(Generic[T]):
    chunks: list[Chunk[T]] = field(default_factory=list)
    admitted: list[Sequence[T]] = field(default_factory=list)  # admitted for the first time
    expired: list[Sequence[T]] = field(default_factory=list)  # deadline passed while waiting: 504
    dropped: list[Sequence[T]] = field(default_factory=list)  # cancelled: their KV is gone
    preempted: list[Sequence[T]] = field(default_factory=list)  # back to the queue: release their KV
    copies: list[CopyBlock] = field(default_factory=list)  # copy-on-write: the engine copies these first
    # images whose features a running sequence's prefill waits for (sequence, image key), oldest
    # sequence first: the engine encodes them between the steps
    encode: list[tuple[Sequence[T], Hashable]] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(len(c.tokens) for c in self.chunks)

    @property
    def empty(self) -> bool:
        return not (self.chunks or self.expired or self.dropped or self.preempted or self.encode)
