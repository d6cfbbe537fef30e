"""The KV-cache block pool: which of the engine's preallocated KV blocks each sequence holds.
Pure logic (no torch): block ids index the engine's one KV tensor per layer
(`accelab.serve.runner.kv_cache`), so the free count here is the memory there.

- A block holds `block_size` consecutive positions of one sequence. A sequence's block table
  lists its blocks in position order; position p lives in block `table[p // block_size]` at
  offset `p % block_size`.
- Reference counts: a block is shared by every sequence whose table lists it (a common prompt
  prefix, a forked choice of n > 1). It returns to the free list when the last one lets go.
- Prefix caching: a block whose positions are all computed is *committed* under a key that
  chains the keys of the blocks before it with its own tokens (an image's positions: the
  image's content key), so equal keys mean equal tokens at equal positions (the content is
  compared too: a hash collision is a miss). A freed block keeps its key and content until it
  is handed out again: a later sequence that starts with the same tokens takes it back
  (`match`) instead of recomputing it. Free blocks are handed out least recently freed first,
  so the prefixes used last survive longest.
- Copy-on-write: a sequence about to write into a block it shares (a fork's partial last
  block, or a cached full block whose last position is fed again) gets a private copy first
  (`writable`); the caller has the engine copy the block's KV before the step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = ["BlockPool", "CopyBlock", "PoolFull"]


class PoolFull(RuntimeError):
    """No free block: the scheduler preempts a sequence and tries again."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CopyBlock:
    """Copy the KV of every position of block `src` into block `dst` (copy-on-write)."""

    src: int
    dst: int


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must both be 1 or more")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._refs = [0] * num_blocks
        self._keys: list[int | None] = [None] * num_blocks
        # (parent key, tokens) of each committed block
        self._content: list[tuple[int | None, tuple[Hashable, ...]] | None] = [None] * num_blocks
        self._by_key: dict[int, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # oldest first
        self.hits = 0  # blocks taken from the prefix cache
        self._cached = 0  # free blocks with a key (kept in step with every change, read per step)

    # -- counts (what the metrics report) -----------------------------------------------------
    @property
    def free(self) -> int:
        """Blocks no sequence holds (cached ones included: they are handed out when needed)."""
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def cached(self) -> int:
        """Free blocks that still hold a committed prefix."""
        return self._cached

    def refs(self, block: int) -> int:
        return self._refs[block]

    def key(self, block: int) -> int | None:
        return self._keys[block]

    def committed_key(self, block: int) -> int:
        """The prefix-cache key of a committed block (one that `match` returned)."""
        key = self._keys[block]
        assert key is not None, f"block {block} holds no committed prefix"
        return key

    # -- handing blocks out and back ------------------------------------------------------------
    def allocate(self) -> int:
        """A fresh block (refcount 1), least recently freed first; its cached prefix is forgotten."""
        if not self._free:
            raise PoolFull(f"all {self.num_blocks} KV blocks are in use")
        block, _ = self._free.popitem(last=False)
        self._forget(block)
        self._refs[block] = 1
        return block

    def take(self, block: int) -> None:
        """One more holder of `block` (a prefix hit, a fork)."""
        if self._refs[block] == 0:
            del self._free[block]
            self._cached -= self._keys[block] is not None
        self._refs[block] += 1

    def release(self, table: Sequence[int]) -> None:
        """A sequence lets go of its blocks. Its last blocks are freed first, so they are handed
        out again before its first ones (a prompt's head is the part others share)."""
        for block in reversed(table):
            assert self._refs[block] > 0, f"block {block} released more often than taken"
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
                self._cached += self._keys[block] is not None

    def writable(self, table: list[int], index: int) -> CopyBlock | None:
        """Make `table[index]` private to this table before a write: a shared block is swapped
        for a fresh copy (returned, for the engine to copy), an unshared committed block forgets
        its key (its content is about to change)."""
        block = table[index]
        if self._refs[block] == 1:
            self._forget(block)
            return None
        fresh = self.allocate()
        self._refs[block] -= 1  # still held by the others: never freed here
        table[index] = fresh
        return CopyBlock(src=block, dst=fresh)

    def fork(self, table: Sequence[int]) -> list[int]:
        """A child's block table: the parent's blocks, shared (copy-on-write happens at the
        first write into a shared block, see `writable`)."""
        for block in table:
            self.take(block)
        return list(table)

    # -- the prefix cache ---------------------------------------------------------------------
    def match(self, tokens: Sequence[Hashable]) -> list[int]:
        """The committed blocks holding the longest prefix of `tokens` made of whole blocks,
        in order; they are not taken yet (`take` each)."""
        if not self.prefix_caching:
            return []
        found: list[int] = []
        parent: int | None = None
        size = self.block_size
        for start in range(0, len(tokens) - size + 1, size):
            chunk = tuple(tokens[start : start + size])
            key = _chain(parent, chunk)
            block = self._by_key.get(key)
            if block is None or self._content[block] != (parent, chunk):
                break
            found.append(block)
            parent = key
        return found

    def commit(self, block: int, parent: int | None, tokens: Sequence[Hashable]) -> int:
        """Every position of `block` is computed, after the prefix whose last block's key is
        `parent`: register it for later sequences. Returns its key (the next block's parent)."""
        chunk = tuple(tokens)
        assert len(chunk) == self.block_size, f"commit of a partial block ({len(chunk)} of {self.block_size} tokens)"
        key = _chain(parent, chunk)
        if not self.prefix_caching:
            return key
        holder = self._by_key.get(key)
        if holder is None or self._content[holder] != (parent, chunk):  # first, or a collision: this one wins
            if holder is not None:
                self._forget(holder)
            self._forget(block)
            self._keys[block], self._content[block] = key, (parent, chunk)
            self._by_key[key] = block
        return key

    def _forget(self, block: int) -> None:
        key = self._keys[block]
        if key is not None:
            self._cached -= self._refs[block] == 0  # a free block (or one just handed out by `allocate`)
            if self._by_key.get(key) == block:
                del self._by_key[key]
            self._keys[block] = self._content[block] = None


def _chain(parent: int | None, tokens: tuple[Hashable, ...]) -> int:
    # within one process only: an image's key in `tokens` is a str, whose hash is salted per process
    return hash((parent, tokens))
