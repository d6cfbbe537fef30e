"""The pure batcher, driven by a fake clock: no threads, no sleeping."""

from __future__ import annotations

import pytest
from fake_clock import FakeClock

from accelab.serve.batcher import Batcher, BatchLimit, BatchPolicy, QueueFull


def make(max_batch_size: int = 4, max_wait_s: float = 0.010, max_queue: int = 100) -> tuple[Batcher, FakeClock]:
    clock = FakeClock()
    policy = BatchPolicy(max_batch_size=max_batch_size, max_wait_s=max_wait_s, max_queue=max_queue)
    return Batcher(policy, clock), clock


def payloads(batch) -> list:
    return [item.payload for item in batch.items]


def test_nothing_to_take_from_an_empty_queue():
    batcher, _ = make()
    assert batcher.take() is None
    assert batcher.wait_s() is None


def test_waits_until_max_wait_counted_from_the_first_request():
    batcher, clock = make(max_batch_size=4, max_wait_s=0.010)
    batcher.add("a")
    clock.advance(0.006)
    batcher.add("b")  # arrives later: the wait still counts from "a"
    assert batcher.take() is None
    assert batcher.wait_s() == pytest.approx(0.004)
    clock.advance(0.0039)
    assert batcher.take() is None
    clock.advance(0.0001)
    batch = batcher.take()
    assert payloads(batch) == ["a", "b"]
    assert len(batcher) == 0


def test_flushes_as_soon_as_the_batch_is_full():
    batcher, clock = make(max_batch_size=3, max_wait_s=10.0)
    for name in "abc":
        batcher.add(name)
    assert batcher.wait_s() == 0.0
    assert payloads(batcher.take()) == ["a", "b", "c"]  # no time passed at all


def test_never_more_than_max_batch_size():
    batcher, clock = make(max_batch_size=4, max_wait_s=0.0)
    for i in range(10):
        batcher.add(i)
    sizes = []
    while (batch := batcher.take()) is not None:
        assert batch.units <= 4
        sizes.append(batch.units)
    assert sizes == [4, 4, 2]


def test_weights_count_inputs_and_a_heavy_item_travels_alone():
    batcher, clock = make(max_batch_size=4, max_wait_s=0.0)
    batcher.add("three", weight=3)
    batcher.add("two", weight=2)  # 3 + 2 > 4: waits for the next batch
    batcher.add("nine", weight=9)
    assert payloads(batcher.take()) == ["three"]
    assert payloads(batcher.take()) == ["two"]  # "nine" does not fit beside it
    batch = batcher.take()
    assert payloads(batch) == ["nine"] and batch.units == 9  # the worker runs it in chunks of 4


def test_keys_never_mix_and_order_is_kept():
    batcher, clock = make(max_batch_size=4, max_wait_s=0.0)
    batcher.add("g1", key="generate")
    batcher.add("e1", key="embed")
    batcher.add("g2", key="generate")
    assert payloads(batcher.take()) == ["g1", "g2"]
    assert payloads(batcher.take()) == ["e1"]


def test_bounded_queue_raises_queue_full():
    batcher, clock = make(max_queue=2)
    batcher.add("a")
    batcher.add("b")
    with pytest.raises(QueueFull, match="max_queue=2"):
        batcher.add("c")
    clock.advance(1)
    batcher.take()
    batcher.add("c")  # room again once a batch left


def test_expired_items_leave_the_queue_and_are_not_batched():
    batcher, clock = make(max_batch_size=4, max_wait_s=1.0)
    batcher.add("slow", timeout_s=0.5)
    batcher.add("patient", timeout_s=10)
    assert batcher.wait_s() == pytest.approx(0.5)  # wakes the worker for the deadline
    clock.advance(0.5)
    batch = batcher.take()
    assert [p.payload for p in batch.expired] == ["slow"] and batch.items == []
    clock.advance(0.5)
    batch = batcher.take()  # max wait counts from "patient"'s arrival, the first still queued
    assert payloads(batch) == ["patient"] and batch.expired == []


def test_cancel_removes_a_queued_item_once():
    batcher, clock = make()
    item = batcher.add("a")
    assert batcher.cancel(item) is True
    assert batcher.cancel(item) is False
    assert batcher.take() is None


def test_flush_hands_out_a_partial_batch_at_once():
    batcher, clock = make(max_wait_s=100.0)
    batcher.add("a")
    assert batcher.take() is None
    assert payloads(batcher.take(flush=True)) == ["a"]


def test_batch_limit_halves_on_oom_and_recovers_after_good_batches():
    limit = BatchLimit(maximum=32, recover_after=3)
    assert limit.lower(32) == 16
    assert limit.lower(16) == 8
    for _ in range(2):
        limit.note_success()
    assert limit.value == 8
    limit.note_success()
    assert limit.value == 16
    assert limit.lower(1) == 1  # never below one


def test_lowered_limit_caps_the_next_batches():
    batcher, clock = make(max_batch_size=8, max_wait_s=0.0)
    batcher.limit.lower(8)
    for i in range(8):
        batcher.add(i)
    assert batcher.take().units == 4


def test_policy_validation_names_the_field():
    with pytest.raises(ValueError, match="max_batch_size=0"):
        BatchPolicy(max_batch_size=0)
    with pytest.raises(ValueError, match="max_wait_s=-1"):
        BatchPolicy(max_wait_s=-1)


def test_when_nothing_else_is_on_its_way_a_batch_goes_at_once():
    batcher, clock = make(max_batch_size=4, max_wait_s=0.010)
    batcher.add("a")
    batcher.add("b")
    assert batcher.take() is None  # more may come: wait for company (up to max_wait)
    assert payloads(batcher.take(quiet=True)) == ["a", "b"]  # every request received is queued
    assert batcher.take(quiet=True) is None  # and quiet never makes a batch out of nothing
