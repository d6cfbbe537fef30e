"""The KV block pool alone and under the scheduler: allocation order, reference counts, prefix
hits on committed blocks, eviction, preemption that frees real blocks, forks with copy-on-write.
Pure logic, exact asserts (block ids included: they index the engine's KV tensor)."""

from __future__ import annotations

import pytest
from fake_clock import FakeClock

from accelab.serve.batcher import QueueFull
from accelab.serve.kv_blocks import BlockPool, CopyBlock, PoolFull
from accelab.serve.scheduler import Scheduler, SchedulerConfig
from accelab.serve.stops import StopRules


# -- the pool ---------------------------------------------------------------------------------
def test_blocks_go_out_in_order_and_come_back_last_first():
    pool = BlockPool(4, 2)
    table = [pool.allocate(), pool.allocate(), pool.allocate()]
    assert table == [0, 1, 2] and (pool.used, pool.free) == (3, 1)
    assert [pool.refs(b) for b in range(4)] == [1, 1, 1, 0]
    pool.release(table)
    assert (pool.used, pool.free) == (0, 4)
    # the free list is oldest first: 3 (never used), then the released table's tail first
    assert [pool.allocate() for _ in range(4)] == [3, 2, 1, 0]
    with pytest.raises(PoolFull, match="all 4 KV blocks are in use"):
        pool.allocate()


def test_a_shared_block_is_freed_when_its_last_holder_lets_go():
    pool = BlockPool(3, 2)
    a = [pool.allocate(), pool.allocate()]
    b = pool.fork(a)
    assert b == [0, 1] and [pool.refs(x) for x in (0, 1, 2)] == [2, 2, 0] and pool.used == 2
    pool.release(a)
    assert [pool.refs(x) for x in (0, 1, 2)] == [1, 1, 0] and pool.free == 1
    pool.release(b)
    assert pool.free == 3 and pool.used == 0
    with pytest.raises(AssertionError, match="released more often than taken"):
        pool.release([0])


def test_committed_blocks_are_matched_by_their_whole_prefix():
    pool = BlockPool(8, 2)
    table = [pool.allocate() for _ in range(3)]  # tokens 1 2 | 3 4 | 5
    k0 = pool.commit(table[0], None, (1, 2))
    k1 = pool.commit(table[1], k0, (3, 4))
    assert pool.key(table[0]) == k0 and pool.key(table[2]) is None
    assert pool.match((1, 2, 3, 4, 5)) == [0, 1]
    assert pool.match((1, 2, 3, 4)) == [0, 1]  # whole blocks only
    assert pool.match((1, 2, 3)) == [0]
    assert pool.match((1, 2, 9, 9)) == [0]  # the second block differs
    assert pool.match((3, 4, 1, 2)) == []  # same tokens at other positions: not the same KV
    assert pool.match((9,)) == [] and k1 != k0


def test_a_freed_committed_block_stays_cached_until_it_is_handed_out_again():
    pool = BlockPool(3, 2)
    table = [pool.allocate(), pool.allocate()]
    k0 = pool.commit(table[0], None, (1, 2))
    pool.commit(table[1], k0, (3, 4))
    pool.release(table)
    assert (pool.free, pool.cached) == (3, 2)
    hits = pool.match((1, 2, 3, 4, 5))
    assert hits == [0, 1]
    for block in hits:
        pool.take(block)
    assert (pool.used, pool.free, pool.cached) == (2, 1, 0) and pool.refs(0) == 1
    pool.release(hits)
    # new allocations evict the least recently freed first: block 2 (never used), then 1, then 0
    assert pool.allocate() == 2 and pool.cached == 2
    assert pool.allocate() == 1 and pool.key(1) is None and pool.match((1, 2, 3, 4)) == [0]
    assert pool.allocate() == 0 and pool.match((1, 2)) == []


def test_without_prefix_caching_nothing_is_matched():
    pool = BlockPool(2, 2, prefix_caching=False)
    block = pool.allocate()
    pool.commit(block, None, (1, 2))
    assert pool.match((1, 2, 3)) == [] and pool.key(block) is None


def test_a_write_into_a_shared_block_gets_a_copy():
    pool = BlockPool(4, 2)
    parent = [pool.allocate(), pool.allocate()]
    child = pool.fork(parent)
    assert pool.writable(child, 1) == CopyBlock(src=1, dst=2)
    assert child == [0, 2] and parent == [0, 1]
    assert [pool.refs(b) for b in range(4)] == [2, 1, 1, 0]
    assert pool.writable(parent, 1) is None  # block 1 is the parent's alone now: written in place


def test_writing_into_a_committed_block_of_ones_own_forgets_its_key():
    pool = BlockPool(2, 2)
    block = pool.allocate()
    pool.commit(block, None, (1, 2))
    table = [block]
    assert pool.writable(table, 0) is None and pool.key(block) is None and pool.match((1, 2)) == []


# -- under the scheduler ------------------------------------------------------------------------
def make(**config) -> Scheduler:
    return Scheduler(SchedulerConfig(**{"max_step_tokens": 64, "prefix_caching": True, **config}), FakeClock())


def run_step(sched: Scheduler, token: int = 7):
    step = sched.schedule()
    for chunk in step.chunks:
        sched.advance(chunk, token if chunk.sample else None)
    return step


def test_admission_allocates_real_blocks_and_decode_grows_them():
    sched = make(kv_blocks=8, block_size=4, max_running=2)
    a = sched.add("a", tuple(range(6)), stops=StopRules(max_tokens=8))  # 6 tokens: 2 blocks
    b = sched.add("b", (1, 2, 3), stops=StopRules(max_tokens=8))  # 1 block
    run_step(sched)
    assert (a.block_table, b.block_table) == ([0, 1], [2])
    assert (sched.used_blocks, sched.free_blocks) == (3, 5)
    run_step(sched)  # a writes position 6, b position 3: both still in their blocks
    assert (a.block_table, b.block_table) == ([0, 1], [2])
    run_step(sched)  # b writes position 4: a new block
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3]) and sched.used_blocks == 4


def test_a_second_sequence_takes_the_committed_prefix_and_prefills_only_the_rest():
    sched = make(kv_blocks=8, block_size=4, max_running=2)
    system = (11, 12, 13, 14, 15, 16, 17, 18)  # two whole blocks: a shared system prompt
    first = sched.add("first", system + (1, 2), stops=StopRules(max_tokens=2))
    run_step(sched)
    assert first.block_table == [0, 1, 2] and len(first.block_keys) == 2  # the two full blocks committed
    second = sched.add("second", system + (3,), stops=StopRules(max_tokens=2))
    step = run_step(sched)
    assert [(c.seq.payload, c.start, len(c.tokens)) for c in step.chunks] == [("first", 10, 1), ("second", 8, 1)]
    assert second.block_table == [0, 1, 3] and sched.pool.refs(0) == 2 and sched.pool.refs(1) == 2
    assert sched.reused_tokens == 8 and sched.pool.hits == 2
    sched.finish(first)
    assert sched.pool.refs(0) == 1 and sched.used_blocks == 3  # still held by `second`
    sched.finish(second)
    assert (sched.used_blocks, sched.free_blocks, sched.cached_blocks) == (0, 8, 2)


def test_a_prompt_of_whole_cached_blocks_feeds_its_last_token_into_a_copy():
    sched = make(kv_blocks=8, block_size=4, max_running=2)
    prompt = (1, 2, 3, 4, 5, 6, 7, 8)
    a = sched.add("a", prompt, stops=StopRules(max_tokens=4))
    run_step(sched)
    b = sched.add("b", prompt, stops=StopRules(max_tokens=4))
    step = run_step(sched)
    # b takes both blocks and recomputes position 7 (its logits pick b's first token): the second
    # block is shared with a, so b writes into a copy of it, made before the step runs
    assert [(c.seq.payload, c.start, len(c.tokens)) for c in step.chunks] == [("a", 8, 1), ("b", 7, 1)]
    assert step.copies == [CopyBlock(src=1, dst=3)]
    assert a.block_table == [0, 1, 2] and b.block_table == [0, 3]
    assert sched.reused_tokens == 7


def test_preemption_frees_real_blocks_and_the_victim_finds_its_own_prefix_again():
    sched = make(kv_blocks=3, block_size=2, max_running=2)
    old = sched.add("old", (1, 2), stops=StopRules(max_tokens=4))
    young = sched.add("young", (3, 4, 5), stops=StopRules(max_tokens=4))
    run_step(sched, token=9)  # old: 1 block; young: 2 blocks; the pool is full
    assert (old.block_table, young.block_table, sched.free_blocks) == ([0], [1, 2], 0)
    assert len(young.block_keys) == 1  # (3, 4) committed
    step = run_step(sched, token=9)  # old writes position 2: a new block, none free
    assert step.preempted == [young] and young.block_table == [] and young.computed == 0
    assert old.block_table == [0, 2] and sched.pool.refs(1) == 0 and sched.cached_blocks == 1
    sched.finish(old)
    step = run_step(sched, token=5)
    # young comes back: its committed block (3, 4) is a hit, so only (5, 9) is recomputed
    assert [(c.start, c.tokens) for c in step.chunks] == [(2, (5, 9))]
    assert young.block_table[0] == 1 and young.generated == [9, 5]


def test_a_fork_shares_the_prompt_blocks_and_copies_the_partial_one_on_write():
    sched = make(kv_blocks=8, block_size=4, max_running=3)
    parent = sched.add("parent", (1, 2, 3, 4, 5, 6), stops=StopRules(max_tokens=4))
    run_step(sched, token=9)  # prefilled, sampled 9: blocks [0, 1], block 0 committed
    child = sched.fork(parent, "child")
    assert child.prompt == parent.prompt and child.generated == [] and child.computed == 5
    assert child.block_table == [0, 1] and [sched.pool.refs(b) for b in (0, 1)] == [2, 2]
    assert sched.reused_tokens == 5  # the shared positions are counted as not computed again
    step = run_step(sched, token=8)
    # parent decodes position 6, child recomputes position 5 (for its own first token): both write
    # into block 1; the parent, first, gets a copy, the child then holds block 1 alone
    assert [(c.seq.payload, c.start, c.tokens) for c in step.chunks] == [("parent", 6, (9,)), ("child", 5, (6,))]
    assert step.copies == [CopyBlock(src=1, dst=2)]
    assert parent.block_table == [0, 2] and child.block_table == [0, 1]
    assert [sched.pool.refs(b) for b in (0, 1, 2)] == [2, 1, 1]
    assert child.generated == [8] and parent.generated == [9, 8]
    sched.finish(parent)
    sched.finish(child)
    assert sched.used_blocks == 0


def test_a_fork_needs_a_running_parent_and_a_free_slot():
    sched = make(kv_blocks=8, block_size=4, max_running=1)
    parent = sched.add("p", (1, 2, 3), stops=StopRules(max_tokens=4))
    with pytest.raises(ValueError, match="only a running sequence can be forked"):
        sched.fork(parent, "c")
    run_step(sched)
    with pytest.raises(QueueFull, match="max_running=1"):
        sched.fork(parent, "c")
    with pytest.raises(ValueError, match="a fork shares 0 to 2 positions"):
        make(max_running=2).fork(parent, "c", tokens=3)


def test_both_prefix_caches_at_once_are_refused():
    with pytest.raises(ValueError, match="two prefix caches"):
        Scheduler(SchedulerConfig(prefix_caching=True), FakeClock(), reuse=lambda seq: 0)


def test_the_cached_count_follows_every_change():
    pool = BlockPool(4, 1)
    table = [pool.allocate() for _ in range(3)]
    key = None
    for block, token in zip(table, (1, 2, 3)):
        key = pool.commit(block, key, (token,))
    assert pool.cached == 0  # held blocks are not counted
    pool.release(table)
    assert pool.cached == 3
    pool.take(pool.match((1, 2))[1])
    assert pool.cached == 2
    assert pool.allocate() == 3 and pool.cached == 2  # never used: no key
    assert pool.allocate() == 2 and pool.cached == 1  # block 2 (token 3) evicted
    assert pool.cached == sum(1 for b in range(4) if pool.refs(b) == 0 and pool.key(b) is not None)
