"""The continuous-batching scheduler alone: a fake clock, no engine, exact asserts."""

from __future__ import annotations

import pytest
from fake_clock import FakeClock

from accelab.serve.batcher import QueueFull
from accelab.serve.scheduler import NeverFits, Scheduler, SchedulerConfig
from accelab.serve.stops import StopRules


def make(**config) -> tuple[Scheduler, FakeClock]:
    clock = FakeClock()
    return Scheduler(SchedulerConfig(**config), clock), clock


def run_step(sched: Scheduler, token: int = 7):
    """Schedule a step and report every chunk done, sampling `token` where one is due."""
    step = sched.schedule()
    for chunk in step.chunks:
        sched.advance(chunk, token if chunk.sample else None)
    return step


def shape(step) -> list[tuple[str, int, int]]:
    return [(c.seq.payload, c.start, len(c.tokens)) for c in step.chunks]


def test_admission_in_arrival_order_up_to_max_running():
    sched, _ = make(max_running=2, max_step_tokens=64)
    for name in "abc":
        sched.add(name, (1, 2, 3), stops=StopRules(max_tokens=4))
    step = run_step(sched)
    assert shape(step) == [("a", 0, 3), ("b", 0, 3)]
    assert [s.payload for s in step.admitted] == ["a", "b"]
    assert (sched.running, sched.waiting) == (2, 1)
    step = run_step(sched)  # both decode; c waits for a slot
    assert shape(step) == [("a", 3, 1), ("b", 3, 1)]
    assert step.chunks[0].tokens == (7,)


def test_a_finished_sequence_leaves_and_a_waiting_one_joins_at_the_next_step():
    sched, _ = make(max_running=2, max_step_tokens=64)
    a = sched.add("a", (1, 2), stops=StopRules(max_tokens=4))
    sched.add("b", (1, 2), stops=StopRules(max_tokens=4))
    sched.add("c", (5, 6, 7), stops=StopRules(max_tokens=4))
    run_step(sched)
    sched.finish(a)
    step = run_step(sched)
    assert shape(step) == [("b", 2, 1), ("c", 0, 3)]  # b keeps decoding while c prefills
    assert [s.payload for s in step.admitted] == ["c"]


def test_token_budget_chunks_a_long_prompt_and_decodes_go_first():
    sched, _ = make(max_running=4, max_step_tokens=8)
    short = sched.add("short", (1, 2), stops=StopRules(max_tokens=10))
    run_step(sched)
    long = sched.add("long", tuple(range(20)), stops=StopRules(max_tokens=4))
    steps = [shape(run_step(sched)) for _ in range(3)]
    # every step: the decode of `short` first, then 7 prompt tokens of `long`, chunk by chunk
    assert steps[0] == [("short", 2, 1), ("long", 0, 7)]
    assert steps[1] == [("short", 3, 1), ("long", 7, 7)]
    assert steps[2] == [("short", 4, 1), ("long", 14, 6)]
    assert long.generated == [7] and long.computed == 20  # sampled at the end of its last chunk
    assert short.generated == [7, 7, 7, 7]


def test_a_chunk_that_does_not_end_the_prompt_samples_nothing():
    sched, _ = make(max_running=1, max_step_tokens=4)
    seq = sched.add("a", (1, 2, 3, 4, 5, 6), stops=StopRules(max_tokens=2))
    step = sched.schedule()
    assert [c.sample for c in step.chunks] == [False]
    sched.advance(step.chunks[0], None)
    step = sched.schedule()
    assert [c.sample for c in step.chunks] == [True]
    with pytest.raises(ValueError, match="needs the sampled token"):
        sched.advance(step.chunks[0], None)
    assert seq.computed == 4


def test_head_of_queue_is_never_overtaken_by_shorter_prompts():
    # the cache holds 4 blocks of 4 tokens; `big` needs 3 blocks and waits for them; `small`
    # (1 block) would fit, but does not jump the queue
    sched, _ = make(max_running=4, max_step_tokens=64, kv_blocks=4, block_size=4)
    first = sched.add("first", tuple(range(8)), stops=StopRules(max_tokens=4))  # 2 blocks
    run_step(sched)
    sched.add("big", tuple(range(12)), stops=StopRules(max_tokens=4))
    sched.add("small", (1,), stops=StopRules(max_tokens=2))
    step = run_step(sched)
    assert shape(step) == [("first", 8, 1)]
    assert sched.waiting == 2
    sched.finish(first)
    step = run_step(sched)
    assert [s.payload for s in step.admitted] == ["big", "small"]


def test_queue_is_bounded_and_a_sequence_that_can_never_fit_is_refused():
    sched, _ = make(max_running=1, max_step_tokens=8, max_queue=2, kv_blocks=2, block_size=4)
    sched.add("a", (1,), stops=StopRules(max_tokens=2))
    sched.add("b", (1,), stops=StopRules(max_tokens=2))
    with pytest.raises(QueueFull, match="max_queue=2"):
        sched.add("c", (1,), stops=StopRules(max_tokens=2))
    with pytest.raises(NeverFits, match="needs 9 tokens of KV cache; the whole cache holds 8"):
        sched.add("d", (1, 2, 3, 4, 5), stops=StopRules(max_tokens=5))
    sched.finish(sched.sequences()[0])  # room in the queue again
    assert sched.add("e", (1, 2, 3, 4), stops=StopRules(max_tokens=5)).max_tokens == 5  # 8 tokens: fits exactly


def test_waiting_past_the_deadline_expires_and_never_runs():
    sched, clock = make(max_running=1, max_step_tokens=8)
    sched.add("running", (1, 2), stops=StopRules(max_tokens=8))
    run_step(sched)
    late = sched.add("late", (3, 4), stops=StopRules(max_tokens=2), timeout_s=5.0)
    assert sched.next_deadline() == 105.0
    clock.advance(4.9)
    assert run_step(sched).expired == []
    clock.advance(0.2)
    step = run_step(sched)
    assert step.expired == [late] and late.state == "done"
    assert sched.waiting == 0 and all(c.seq is not late for c in step.chunks)


def test_an_admitted_sequence_no_longer_has_a_deadline():
    sched, clock = make(max_running=1, max_step_tokens=8)
    seq = sched.add("a", (1, 2), stops=StopRules(max_tokens=8), timeout_s=1.0)
    run_step(sched)
    clock.advance(10)
    assert run_step(sched).expired == [] and seq.state == "running"


def test_cancel_frees_the_slot_and_blocks_at_the_next_step():
    sched, _ = make(max_running=1, max_step_tokens=8, kv_blocks=4, block_size=4)
    a = sched.add("a", (1, 2, 3, 4, 5), stops=StopRules(max_tokens=4))
    sched.add("b", (1, 2), stops=StopRules(max_tokens=4))
    run_step(sched)
    assert sched.used_blocks == 2
    assert sched.cancel(a) is False  # it ran: it leaves at the next step
    step = run_step(sched)
    assert step.dropped == [a] and a.state == "done"
    assert shape(step) == [("b", 0, 2)]  # its slot went to b in the same step
    assert sched.used_blocks == 1
    # a waiting sequence leaves at once
    c = sched.add("c", (1,), stops=StopRules(max_tokens=2))
    assert sched.cancel(c) is True and sched.waiting == 0
    assert sched.cancel(c) is False  # twice is harmless


def test_kv_growth_preempts_the_youngest_which_is_recomputed_later():
    sched, _ = make(max_running=2, max_step_tokens=16, kv_blocks=2, block_size=2)
    old = sched.add("old", (1, 2), stops=StopRules(max_tokens=3))  # 1 block
    young = sched.add("young", (3, 4), stops=StopRules(max_tokens=3))  # 1 block: the cache is full
    run_step(sched, token=9)  # both prefilled, each sampled a token: 3 tokens, 1 block each
    step = run_step(sched, token=9)
    # old decodes position 2 and needs a second block: the youngest is preempted for it
    assert step.preempted == [young] and sched.preemptions == 1
    assert young.state == "waiting" and young.computed == 0 and young.generated == [9]
    assert shape(step) == [("old", 2, 1)]
    sched.finish(old)
    step = run_step(sched, token=5)
    # young comes back: prompt and its generated token are recomputed in one chunk, then it samples
    assert shape(step) == [("young", 0, 3)]
    assert step.chunks[0].tokens == (3, 4, 9) and young.generated == [9, 5]
    assert step.admitted == []  # admitted before: not counted as new


def test_the_youngest_needing_a_block_preempts_itself_and_the_older_one_decodes_on():
    sched, _ = make(max_running=2, max_step_tokens=8, kv_blocks=2, block_size=2)
    old = sched.add("old", (1,), stops=StopRules(max_tokens=1))  # decodes position 1: still its first block
    young = sched.add("young", (1, 2), stops=StopRules(max_tokens=3))  # decodes position 2: needs a second block
    run_step(sched)
    step = run_step(sched)
    assert step.preempted == [young] and shape(step) == [("old", 1, 1)]
    assert old.state == "running" and young.state == "waiting"


def test_config_checks_name_the_field():
    with pytest.raises(ValueError, match="max_running=0 must be 1 or more"):
        SchedulerConfig(max_running=0)
    with pytest.raises(ValueError, match="max_step_tokens=8 must be more than max_running=8"):
        SchedulerConfig(max_running=8, max_step_tokens=8)


def test_reused_prefix_is_not_prefilled_again_but_the_last_token_always_is(clock):
    held = {"a": 3, "b": 99}  # the engine holds a's first 3 tokens; claims more than b has
    sched = Scheduler(SchedulerConfig(max_running=2, max_step_tokens=64), clock, reuse=lambda seq: held[seq.payload])
    a = sched.add("a", (1, 2, 3, 4, 5), stops=StopRules(max_tokens=4))
    b = sched.add("b", (1, 2), stops=StopRules(max_tokens=4))
    step = run_step(sched)
    assert shape(step) == [("a", 3, 2), ("b", 1, 1)]
    assert a.generated == [7] and b.generated == [7]
    assert sched.reused_tokens == 4 and sched.used_blocks == 2  # reused tokens still hold their blocks


class Slots:
    """An engine's own per-sequence state, as llama.cpp's slots are: `reuse` claims one at
    admission (and fails when none is free), `release` gives it back."""

    def __init__(self, n: int):
        self.free, self.events = n, []

    def reuse(self, seq) -> int:
        assert self.free > 0, f"no free slot for {seq.payload}: one that left was not released first"
        self.free -= 1
        self.events.append(("claim", seq.payload))
        return 0

    def release(self, seq) -> None:
        self.free += 1
        self.events.append(("release", seq.payload))


def test_a_sequence_that_leaves_releases_the_engines_state_before_another_is_admitted_in_that_step(clock):
    """Found by fuzzing the llama.cpp server: a stream cut short (its sequences cancelled) and the
    next request in the same step took a slot still held by the cancelled one, and the worker died."""
    slots = Slots(1)
    config = SchedulerConfig(max_running=1, max_step_tokens=8)
    sched = Scheduler(config, clock, reuse=slots.reuse, release=slots.release)
    a = sched.add("a", (1, 2), stops=StopRules(max_tokens=4))
    run_step(sched)
    sched.cancel(a)
    sched.add("b", (3, 4), stops=StopRules(max_tokens=4))
    step = run_step(sched)
    assert step.dropped == [a] and shape(step) == [("b", 0, 2)]
    assert slots.events == [("claim", "a"), ("release", "a"), ("claim", "b")]


def test_a_preempted_sequence_releases_the_engines_state_at_once(clock):
    slots = Slots(2)
    config = SchedulerConfig(max_running=2, max_step_tokens=16, kv_blocks=2, block_size=2)
    sched = Scheduler(config, clock, reuse=slots.reuse, release=slots.release)
    old = sched.add("old", (1, 2), stops=StopRules(max_tokens=3))
    young = sched.add("young", (3, 4), stops=StopRules(max_tokens=3))
    run_step(sched)
    step = run_step(sched)
    assert step.preempted == [young] and slots.events[-1] == ("release", "young") and slots.free == 1
    sched.finish(old)
    assert slots.events[-1] == ("release", "old") and slots.free == 2
    run_step(sched)  # young comes back: it claims a slot again
    assert slots.events[-1] == ("claim", "young") and slots.free == 1


def advance_all(sched: Scheduler, tokens: dict[str, int]) -> dict[str, str | None]:
    """One step; each sampling chunk gets its sequence's token; the scheduler's verdict per sequence."""
    step = sched.schedule()
    return {c.seq.payload: sched.advance(c, tokens[c.seq.payload] if c.sample else None) for c in step.chunks}


def test_the_scheduler_decides_a_length_stop():
    sched, _ = make(max_running=2, max_step_tokens=16)
    seq = sched.add("a", (1, 2), stops=StopRules(max_tokens=2))
    assert advance_all(sched, {"a": 5}) == {"a": None}
    assert advance_all(sched, {"a": 5}) == {"a": "length"}
    assert seq.finish_reason == "length" and seq.generated == [5, 5]
    sched.finish(seq)
    assert sched.idle and sched.used_blocks == 0


def test_the_scheduler_decides_end_tokens_after_min_tokens():
    sched, _ = make(max_running=2, max_step_tokens=16)
    ends = frozenset({9})
    early = sched.add("early", (1,), stops=StopRules(max_tokens=8, min_tokens=1, end_ids=ends))
    plain = sched.add("plain", (2,), stops=StopRules(max_tokens=8, end_ids=ends))
    assert advance_all(sched, {"early": 9, "plain": 9}) == {"early": None, "plain": "stop"}
    sched.finish(plain)
    assert advance_all(sched, {"early": 9}) == {"early": "stop"}  # past min_tokens now
    assert early.generated == [9, 9] and plain.generated == [9]


def with_images(ids: tuple[int, ...], images: dict[str, int], rows: int = 4) -> tuple:
    """`ids` as the prefix cache keys them, with image `key` at the position given (rows positions)."""
    keyed: list = list(ids)
    for key, start in images.items():
        keyed[start : start + rows] = [(key, r) for r in range(rows)]
    return tuple(keyed)


def test_a_prefill_chunk_ends_before_an_image_the_step_has_no_encoder_budget_for():
    """One image's encoding a step: a prompt with two images is prefilled in two chunks, and a
    sequence whose prompt starts with an image waits for a step with budget left, while text and
    decodes go on. The step that gives the text prompt its first token leaves the image chunk
    for the next one."""
    sched, _ = make(max_running=4, max_step_tokens=64, kv_blocks=64, block_size=4, max_step_images=1)
    ids = tuple(range(100, 114))
    sched.add("two", ids, stops=StopRules(max_tokens=2), cache_prompt=with_images(ids, {"A": 3, "B": 9}))
    sched.add("first", ids[:6], stops=StopRules(max_tokens=2), cache_prompt=with_images(ids[:6], {"C": 0}))
    sched.add("text", ids[:5], stops=StopRules(max_tokens=2))
    step = run_step(sched)
    assert shape(step) == [("text", 0, 5)]  # "two" up to image B left out, "first" has no encoder budget
    assert [s.payload for s in step.admitted] == ["two", "first", "text"]
    assert shape(run_step(sched)) == [("text", 5, 1), ("two", 0, 9)]  # up to image B
    assert shape(run_step(sched)) == [("text", 6, 1), ("two", 9, 5)]  # image B now; C still waits
    assert shape(run_step(sched)) == [("two", 14, 1), ("text", 7, 1), ("first", 0, 6)]


def test_no_encoder_budget_cap_by_default():
    sched, _ = make(max_step_tokens=64, kv_blocks=64, block_size=4)
    ids = tuple(range(100, 114))
    sched.add("two", ids, stops=StopRules(max_tokens=2), cache_prompt=with_images(ids, {"A": 3, "B": 9}))
    assert shape(run_step(sched)) == [("two", 0, 14)]
    with pytest.raises(ValueError, match="max_step_images=-1"):
        SchedulerConfig(max_step_images=-1)


def test_a_text_prompts_first_token_goes_in_a_step_without_image_chunks_held_once_at_most():
    """A step that samples a text prompt's first token leaves out the chunks over image positions
    (each image brings tens to hundreds of prompt tokens: the text's first token would wait for
    them); the next step has them even when another text prompt starts there. A chunk of an image
    prompt past its images (its text after the picture) is not held."""
    sched = Scheduler(
        SchedulerConfig(max_running=4, max_step_tokens=64, kv_blocks=64, block_size=4),
        FakeClock(),
        ready={"A"}.__contains__,
    )
    ids = tuple(range(100, 114))
    sched.add("pic", ids, stops=StopRules(max_tokens=3), cache_prompt=with_images(ids, {"A": 3}))
    sched.add("text", ids[:5], stops=StopRules(max_tokens=3))
    step = run_step(sched)
    assert shape(step) == [("text", 0, 5)]  # "pic" admitted, its chunk over image A left out
    assert [s.payload for s in step.admitted] == ["pic", "text"]
    sched.add("text2", ids[:4], stops=StopRules(max_tokens=3))
    assert shape(run_step(sched)) == [("text", 5, 1), ("pic", 0, 14), ("text2", 0, 4)]  # held once only
    sched.add("text3", ids[:6], stops=StopRules(max_tokens=3))
    assert shape(run_step(sched)) == [("pic", 14, 1), ("text", 6, 1), ("text2", 4, 1), ("text3", 0, 6)]
    tail = Scheduler(
        SchedulerConfig(max_running=4, max_step_tokens=8, kv_blocks=64, block_size=4),
        FakeClock(),
        ready={"A"}.__contains__,
    )
    tail.add("pic", ids, stops=StopRules(max_tokens=3), cache_prompt=with_images(ids, {"A": 3}))
    assert shape(run_step(tail)) == [("pic", 0, 8)]  # through image A
    tail.add("text", ids[:2], stops=StopRules(max_tokens=3))
    assert shape(run_step(tail)) == [("pic", 8, 6), ("text", 0, 2)]  # its text after A goes on


def test_a_prefill_chunk_waits_before_an_image_whose_features_are_not_ready():
    """An engine that encodes images between the steps (`ready`): the chunk stops before an image
    it has no features for, the step lists that image (its sequence's first not ready one, even
    past the chunk) for the engine, and decodes and text go on; once ready, the prefill goes on."""
    ready: set[str] = set()
    sched = Scheduler(
        SchedulerConfig(max_running=4, max_step_tokens=64, kv_blocks=64, block_size=4),
        FakeClock(),
        ready=ready.__contains__,
    )
    ids = tuple(range(100, 114))
    two = sched.add("two", ids, stops=StopRules(max_tokens=2), cache_prompt=with_images(ids, {"A": 3, "B": 9}))
    first = sched.add("first", ids[:6], stops=StopRules(max_tokens=2), cache_prompt=with_images(ids[:6], {"C": 0}))
    sched.add("text", ids[:5], stops=StopRules(max_tokens=2))
    step = run_step(sched)
    assert shape(step) == [("two", 0, 3), ("text", 0, 5)]  # "first" admitted, nothing to feed before C
    assert [(s.payload, key) for s, key in step.encode] == [("two", "A"), ("first", "C")]
    ready.add("A")
    step = run_step(sched)
    assert shape(step) == [("text", 5, 1), ("two", 3, 6)]  # through A, up to B
    assert [(s, key) for s, key in step.encode] == [(two, "B"), (first, "C")]
    ready.update("BC")
    step = run_step(sched)
    assert shape(step) == [("text", 6, 1), ("two", 9, 5), ("first", 0, 6)] and not step.encode
    only_waiting = Scheduler(
        SchedulerConfig(max_step_tokens=64, kv_blocks=64, block_size=4), FakeClock(), ready=set().__contains__
    )
    only_waiting.add("first", ids[:6], stops=StopRules(max_tokens=2), cache_prompt=with_images(ids[:6], {"C": 0}))
    step = only_waiting.schedule()
    assert not step.chunks and not step.empty  # the worker must run it: the engine encodes C


def test_image_work_after_a_step_waits_for_a_text_prompts_first_token_never_twice_in_a_row():
    """Text first between the steps too: while a prompt the next step can prefill waits on no image
    (a text prompt, or one whose images are encoded), preparing image requests and the encoder's
    slice wait for that step; after a step that held them they go, whatever waits. A prompt that
    waits for room in a full batch does not count; without an encoder nothing is held."""
    ready: set[str] = set()
    sched = Scheduler(
        SchedulerConfig(max_running=2, max_step_tokens=64, kv_blocks=64, block_size=4),
        FakeClock(),
        ready=ready.__contains__,
    )
    ids = tuple(range(100, 114))
    pic = sched.add("pic", ids, stops=StopRules(max_tokens=3), cache_prompt=with_images(ids, {"A": 0}))
    assert not sched.first_token_due() and not sched.hold_image_work()  # only a prompt waiting on image A
    sched.add("text", ids[:5], stops=StopRules(max_tokens=3))
    assert sched.first_token_due()
    assert sched.hold_image_work() and sched.hold_image_work(again=True)  # asked twice after one step: held
    assert not sched.hold_image_work()  # the step after one that held: the image work goes
    run_step(sched)  # "text" gets its first token; "pic" waits on A
    assert not sched.first_token_due()
    sched.add("late", ids[:3], stops=StopRules(max_tokens=3))  # the batch is full (pic, text): it waits for room
    assert not sched.first_token_due() and not sched.hold_image_work()
    ready.add("A")  # pic's image encoded: its prefill is due, and it is running
    assert pic.state == "running" and sched.first_token_due() and sched.hold_image_work()
    plain, _ = make(max_step_tokens=64, kv_blocks=64, block_size=4)
    plain.add("text", ids[:5], stops=StopRules(max_tokens=3))
    assert not plain.first_token_due() and not plain.hold_image_work()  # no encoder: nothing to hold


def test_another_choice_forks_the_first_ones_blocks_with_prefix_caching_else_queues_forked_from_it():
    ids = tuple(range(100, 109))
    paged, _ = make(max_running=2, max_step_tokens=64, kv_blocks=64, block_size=4, prefix_caching=True)
    first = paged.add("c0", ids, stops=StopRules(max_tokens=4))
    run_step(paged)  # prefilled, first token picked
    child = paged.add_choice(first, "c1")
    assert child.state == "running" and child.prompt == first.prompt and child.stops is first.stops
    assert child.block_table[:2] == first.block_table[:2] and child.computed == len(ids) - 1  # shared prompt KV
    third = paged.add_choice(first, "c2")  # no slot left (max_running=2): it queues, forked from the first
    assert third.state == "waiting" and third.forked_from is first and paged.waiting == 1
    per_sequence, _ = make(max_step_tokens=64, kv_blocks=64, block_size=4, max_queue=1)
    first = per_sequence.add("c0", ids, stops=StopRules(max_tokens=4))
    run_step(per_sequence)
    per_sequence.add("other", ids[:3], stops=StopRules(max_tokens=4))  # the queue is full now
    queued = per_sequence.add_choice(first, "c1")  # accepted with its request: never refused for the queue
    assert queued.state == "waiting" and queued.forked_from is first and per_sequence.waiting == 2
