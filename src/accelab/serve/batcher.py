"""The dynamic batcher's core: pure logic, no torch, no asyncio, no threads; the clock is injected.

Rules (each has a unit test with a fake clock):
- a batch is ready when the head-of-line key has `limit` units waiting, or when the FIRST
  item of the batch has waited `max_wait_s` (the wait is counted from that item's arrival),
  or when no other request is on its way (`quiet`: every request the server has received is
  queued or running), since waiting longer then only adds latency;
- a batch holds items of one key only (generation and embedding never mix), in arrival order,
  and never more than `limit` units (an item's weight is its number of inputs); one item
  heavier than the limit travels alone and the worker runs it in chunks of the limit;
- the queue is bounded in items: `add` raises `QueueFull` past `max_queue`;
- an item whose deadline has passed leaves the queue in `Batch.expired`, never to be run;
- `limit` drops when a batch runs out of memory and climbs back after a run of good batches.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


class QueueFull(Exception):
    """The bounded queue holds `max_queue` items already; the caller answers 429."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchPolicy:
    max_batch_size: int = 32  # units per batch (inputs, prompts or images)
    max_wait_s: float = 0.005  # counted from the first item of the batch
    max_queue: int = 256  # items waiting (requests); more get 429
    recover_after: int = 32  # good batches in a row before a lowered limit doubles again

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_queue", "recover_after"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be 1 or more")
        if self.max_wait_s < 0:
            raise ValueError(f"max_wait_s={self.max_wait_s} must be 0 or more (seconds)")


@dataclass(kw_only=True, slots=True, eq=False)
class Pending(Generic[T]):
    """One queued item. `deadline` is an absolute time on the batcher's clock, or None."""

    payload: T
    key: str
    weight: int
    arrival: float
    deadline: float | None
    seq: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class Batch(Generic[T]):
    items: list[Pending[T]] = field(default_factory=list)
    expired: list[Pending[T]] = field(default_factory=list)  # deadline passed in the queue: 504, not run

    @property
    def units(self) -> int:
        return sum(item.weight for item in self.items)


class BatchLimit:
    """The batch size the worker tries next: halved on out-of-memory, doubled back (up to the
    configured maximum) after `recover_after` good batches in a row."""

    def __init__(self, maximum: int, recover_after: int):
        self.maximum = maximum
        self.value = maximum
        self._recover_after = recover_after
        self._good = 0

    def lower(self, failed_size: int) -> int:
        self.value = max(1, min(self.value, failed_size // 2))
        self._good = 0
        return self.value

    def note_success(self) -> None:
        if self.value >= self.maximum:
            return
        self._good += 1
        if self._good >= self._recover_after:
            self.value = min(self.maximum, self.value * 2)
            self._good = 0


class Batcher(Generic[T]):
    def __init__(self, policy: BatchPolicy, clock: Callable[[], float]):
        self.policy = policy
        self.limit = BatchLimit(policy.max_batch_size, policy.recover_after)
        self._clock = clock
        self._pending: list[Pending[T]] = []
        self._seq = itertools.count()

    # -- queue ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._pending)

    @property
    def pending_units(self) -> int:
        return sum(item.weight for item in self._pending)

    def add(self, payload: T, *, key: str = "default", weight: int = 1, timeout_s: float | None = None) -> Pending[T]:
        if weight < 1:
            raise ValueError(f"weight={weight} must be 1 or more")
        if len(self._pending) >= self.policy.max_queue:
            raise QueueFull(f"{len(self._pending)} requests are queued (max_queue={self.policy.max_queue})")
        now = self._clock()
        item = Pending(
            payload=payload,
            key=key,
            weight=weight,
            arrival=now,
            deadline=None if timeout_s is None else now + timeout_s,
            seq=next(self._seq),
        )
        self._pending.append(item)
        return item

    def cancel(self, item: Pending[T]) -> bool:
        """Remove a queued item (its client gave up); False when it already left the queue."""
        try:
            self._pending.remove(item)
        except ValueError:
            return False
        return True

    # -- batches --------------------------------------------------------------------------
    def take(self, *, flush: bool = False, quiet: bool = False) -> Batch[T] | None:
        """The next batch if one is ready (any batch at all when `flush` or `quiet`), with the
        items that expired meanwhile; None when there is nothing to hand out."""
        now = self._clock()
        expired = [p for p in self._pending if p.deadline is not None and p.deadline <= now]
        if expired:
            self._pending = [p for p in self._pending if p not in expired]
        chosen = self._head_batch()
        ready = bool(chosen) and (
            flush
            or quiet
            or sum(p.weight for p in chosen) >= self.limit.value
            or now - chosen[0].arrival >= self.policy.max_wait_s
        )
        if not ready:
            return Batch(expired=expired) if expired else None
        taken = set(map(id, chosen))
        self._pending = [p for p in self._pending if id(p) not in taken]
        return Batch(items=chosen, expired=expired)

    def wait_s(self) -> float | None:
        """Seconds until `take` would hand out a batch (0: now), or None when the queue is empty.
        Accounts for the next deadline too, so expired items are answered on time."""
        if not self._pending:
            return None
        now = self._clock()
        chosen = self._head_batch()
        if sum(p.weight for p in chosen) >= self.limit.value:
            return 0.0
        until = chosen[0].arrival + self.policy.max_wait_s - now
        deadlines = [p.deadline - now for p in self._pending if p.deadline is not None]
        return max(0.0, min([until, *deadlines]))

    def _head_batch(self) -> list[Pending[T]]:
        """Items of the head's key in arrival order, up to `limit` units (at least the head).
        Items of another key wait; they cannot starve: the head is the oldest item, so each
        item reaches the head within `max_wait_s` plus the batches ahead of it."""
        if not self._pending:
            return []
        head = self._pending[0]
        chosen, units = [head], head.weight
        for item in self._pending[1:]:
            if item.key != head.key:
                continue
            if units + item.weight > self.limit.value:
                break
            chosen.append(item)
            units += item.weight
        return chosen
