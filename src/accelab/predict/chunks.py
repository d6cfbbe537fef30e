"""The work plan of one attempt: which items, in which batches, on which rank. Pure: no torch, no I/O.

Items are keyed by their input index, never by rank, so a run resumes with any number of
processes: the items already in completed chunk files are done; the rest are ordered (texts
longest first, so a batch holds texts of similar length and little padding; images in input
order), cut into chunks of `chunk_size`, and the chunks dealt to ranks round-robin (with
texts sorted longest first, round-robin gives every rank a similar mix of lengths). Batches
never straddle chunks, so the same inputs, chunk size and batch size give the same batches
whatever the number of processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class Chunk:
    """A unit of resumable work: once its file is written, its items are never computed again."""

    attempt: int
    number: int  # position in the attempt's plan
    rank: int
    indices: tuple[int, ...]  # item indices, in processing order

    @property
    def name(self) -> str:
        return f"a{self.attempt:03d}-rank{self.rank}-chunk{self.number:05d}"

    def batches(self, batch_size: int) -> list[list[int]]:
        return [list(self.indices[i : i + batch_size]) for i in range(0, len(self.indices), batch_size)]


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkPlan:
    attempt: int
    total: int  # items in the source
    done_before: int  # items in chunk files of earlier attempts
    chunks: tuple[Chunk, ...]

    @property
    def remaining(self) -> int:
        return sum(len(c.indices) for c in self.chunks)

    def for_rank(self, rank: int) -> list[Chunk]:
        return [c for c in self.chunks if c.rank == rank]


def remaining_items(total: int, done: set[int]) -> list[int]:
    return [i for i in range(total) if i not in done]


def processing_order(items: Sequence[int], lengths: Sequence[int] | None) -> list[int]:
    """Longest first (ties in input order) when lengths are known, else input order."""
    if lengths is None:
        return list(items)
    return sorted(items, key=lambda i: (-lengths[i], i))


def plan_work(
    *, total: int, done: set[int], lengths: Sequence[int] | None, chunk_size: int, world_size: int, attempt: int
) -> WorkPlan:
    if chunk_size < 1 or world_size < 1:
        raise ValueError(f"chunk_size={chunk_size} and world_size={world_size} must be 1 or more")
    order = processing_order(remaining_items(total, done), lengths)
    pieces = [tuple(order[i : i + chunk_size]) for i in range(0, len(order), chunk_size)]
    chunks = tuple(
        Chunk(attempt=attempt, number=k, rank=k % world_size, indices=piece) for k, piece in enumerate(pieces)
    )
    return WorkPlan(attempt=attempt, total=total, done_before=len(done), chunks=chunks)


def rounded_chunk_size(chunk_size: int, batch_size: int) -> int:
    """chunk_size rounded up to whole batches (a partial batch per chunk would waste a forward)."""
    return -(-chunk_size // batch_size) * batch_size
