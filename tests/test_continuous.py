"""The continuous worker (a real thread) over the FAKE step engine: joining and leaving the
running batch per step, failures that stay with their sequence, cancellation, deadlines.

No test waits on real time. The worker runs on the fake clock, and the test drives the engine
(`GatedSteps`): "long is decoding" is "after 3 steps", and a deadline passes when the test moves
the clock. Real time only bounds the waits for the worker thread (`GUARD_S`), so a hang fails
instead of blocking the run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from fake_clock import FakeClock
from fakes_serve import POISON, FakeGenerationEngine, FakeStepEngine, word_id

from accelab.serve.batcher import QueueFull
from accelab.serve.continuous import ContinuousWorker
from accelab.serve.engines.base import GenUnit, PayloadTooLarge, Prompt, SamplingParams, StepInput
from accelab.serve.jobs import Job, JobOutcome, JobRun, ShuttingDown
from accelab.serve.scheduler import SchedulerConfig

GUARD_S = 30.0  # real seconds a wait on the worker thread may take before the test fails


class GatedSteps(FakeStepEngine):
    """FAKE: the fake step engine, driven by the test. While the gate is closed each step holds
    until the test `allow`s it; once `open`, every step runs at once. A step moves the fake clock
    by `step_s`, so time passes only with steps, or when the test moves the clock."""

    def __init__(self, owner: FakeGenerationEngine, *, clock: FakeClock, step_s: float = 0.0, gated: bool = True):
        super().__init__(owner)
        self.clock = clock
        self.step_s = step_s
        self.entered = 0  # engine steps begun (the last one may be held at the gate)
        self._allowed = 0  # steps the test let through
        self._open = not gated
        self._gate = threading.Condition()

    def step(self, inputs: list[StepInput]) -> list[int]:
        with self._gate:
            self.entered += 1
            self._gate.notify_all()
            if not self._gate.wait_for(lambda: self._open or self._allowed >= self.entered, GUARD_S):
                raise RuntimeError(f"FAKE: step {self.entered} was never allowed (a stuck test)")
        self.clock.advance(self.step_s)  # only here, or in the test while this thread is held
        return super().step(inputs)

    def allow(self, n: int = 1) -> None:
        """Let `n` more steps run, then return once the worker holds at the gate of the step after
        them: every token of those steps is taken, streamed and answered, and the held step's
        inputs are scheduled. `allow(0)`: wait for the first step (its sequences admitted)."""
        with self._gate:
            self._allowed += n
            self._gate.notify_all()
            target = self._allowed + 1
            assert self._gate.wait_for(lambda: self.entered >= target, GUARD_S), (
                f"the worker never reached step {target} ({self.entered} begun)"
            )

    def open(self) -> None:
        with self._gate:
            self._open = True
            self._gate.notify_all()


class Answers:
    """Collects every `done` call, in order."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.outcomes: dict[str, list[JobOutcome]] = {}
        self._cond = threading.Condition()

    def job(
        self,
        name: str,
        *words: str,
        max_tokens: int = 4,
        timeout_s: float | None = None,
        pieces: list[str] | None = None,
    ) -> Job:
        ids = tuple(word_id(w) for w in words or ("hello",))
        unit = GenUnit(
            prompt=Prompt(ids=ids, prompt_tokens=len(ids)),
            params=SamplingParams(max_tokens=max_tokens, temperature=0),
            on_text=pieces.append if pieces is not None else (lambda text: None),
        )

        def done(outcome: JobOutcome) -> None:
            with self._cond:
                self.order.append(name)
                self.outcomes.setdefault(name, []).append(outcome)
                self._cond.notify_all()

        return Job(key="generate", units=[unit], run=lambda units: [], done=done, timeout_s=timeout_s)

    def wait_for(self, *names: str) -> None:
        with self._cond:
            answered = self._cond.wait_for(lambda: all(n in self.outcomes for n in names), GUARD_S)
            assert answered, f"no answer for {set(names) - set(self.outcomes)}"


def eventually(condition: Callable[[], bool], what: str) -> None:
    """Poll `condition`: the worker thread has no event for "went idle" (it settles after its
    last answer). The deadline only turns a hang into a failure."""
    deadline = time.monotonic() + GUARD_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


@pytest.fixture
def setup(clock: FakeClock):
    made: list[tuple[ContinuousWorker, GatedSteps]] = []

    def build(
        *, gated: bool = False, step_s: float = 0.0, start: bool = True, **limits: Any
    ) -> tuple[ContinuousWorker, Answers, GatedSteps]:
        fake = FakeGenerationEngine(name="fake")
        steps = GatedSteps(fake, clock=clock, step_s=step_s, gated=gated)
        limits = {"max_running": 4, "max_step_tokens": 64, "kv_blocks": 64, "block_size": 4, **limits}
        worker = ContinuousWorker(steps, SchedulerConfig(**limits), decode=fake.decode, eos_ids=(), clock=clock)
        if start:
            worker.start()
        made.append((worker, steps))
        return worker, Answers(), steps

    yield build
    for worker, steps in made:
        steps.open()  # a test that failed midway leaves the gate closed
        assert worker.stop(timeout_s=GUARD_S)


def test_a_short_request_sent_later_finishes_first_and_tokens_stream_one_by_one(setup):
    worker, answers, steps = setup(gated=True)
    pieces: list[str] = []
    long_pieces: list[str] = []
    worker.submit(answers.job("long", max_tokens=40, pieces=long_pieces))
    steps.allow(3)  # long is decoding
    assert long_pieces == [" w0", " w1", " w2"]
    worker.submit(answers.job("short", max_tokens=3, pieces=pieces))
    seen = []
    for _ in range(4):  # the held step was scheduled before short came; then short's 3 steps
        steps.allow(1)
        seen.append(list(pieces))
    assert seen == [[], [" w0"], [" w0", " w1"], [" w0", " w1", " w2"]]  # one piece per step, not one at the end
    assert answers.order == ["short"]  # answered while long decodes on
    steps.open()
    answers.wait_for("long", "short")
    assert answers.order == ["short", "long"]
    assert answers.outcomes["short"][0].outputs[0].text == " w0 w1 w2"
    assert pieces == [" w0", " w1", " w2"]
    long = answers.outcomes["long"][0].outputs[0]
    assert long.completion_tokens == 40 and long.finish_reason == "length"
    # short joined the running batch: every step of short carried long too
    assert [len(step) for step in steps.steps if any(i.seq_id == 1 for i in step)] == [2, 2, 2]


def test_a_failing_sequence_fails_alone_and_every_job_gets_one_answer(setup):
    worker, answers, steps = setup()
    worker.submit(answers.job("good1", max_tokens=6))
    worker.submit(answers.job("bad", POISON, max_tokens=6))
    worker.submit(answers.job("good2", max_tokens=6))
    answers.wait_for("good1", "bad", "good2")
    assert [o.outputs[0].text for o in answers.outcomes["good1"] + answers.outcomes["good2"]] == [
        " w0 w1 w2 w3 w4 w5"
    ] * 2
    [bad] = answers.outcomes["bad"]
    assert bad.error_kind == "model_error" and "FAKE model error" in str(bad.error)
    eventually(lambda: worker.idle, "the worker never went idle")
    assert all(len(v) == 1 for v in answers.outcomes.values())
    assert set(steps.released) == {0, 1, 2}  # every sequence's KV freed


def test_a_client_that_goes_away_frees_its_slot_and_kv_at_the_next_step(setup):
    worker, answers, steps = setup(gated=True, max_running=1)
    job = answers.job("gone", max_tokens=200)
    worker.submit(job)
    worker.submit(answers.job("next", max_tokens=2))
    steps.allow(3)  # gone has 3 tokens; its 4th step is held
    assert worker.depth == 1  # `next` waits for the only slot
    job.units[0].cancelled = True  # what the route does when the stream's client leaves
    steps.allow(1)  # the held step ends; the next one drops gone and admits next
    assert answers.order == ["gone"] and answers.outcomes["gone"][0].error_kind == "cancelled"
    assert steps.released == [0] and worker.depth == 0
    steps.open()
    answers.wait_for("gone", "next")
    assert answers.outcomes["next"][0].outputs[0].text == " w0 w1"
    gone_steps = sum(1 for step in steps.steps if any(i.seq_id == 0 for i in step))
    assert gone_steps == 4  # it stopped at the step after its client left, not after its 200 tokens


class FaultyReuse(FakeStepEngine):
    """FAKE: a prefix cache of the engine's own whose first claim fails (a bug's stand-in)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.faults = 1

    def reuse_prefix(self, seq_id: int, tokens) -> int:
        if self.faults:
            self.faults -= 1
            raise RuntimeError("FAKE scheduling fault")
        return 0


def test_a_fault_while_scheduling_fails_the_held_requests_and_the_worker_serves_the_next(clock):
    fake = FakeGenerationEngine(name="fake")
    engine = FaultyReuse(fake)
    config = SchedulerConfig(max_running=4, max_step_tokens=64, kv_blocks=64, block_size=4)
    worker = ContinuousWorker(engine, config, decode=fake.decode, eos_ids=(), clock=clock)
    worker.start()
    try:
        answers = Answers()
        worker.submit(answers.job("first", max_tokens=3))
        answers.wait_for("first")
        [first] = answers.outcomes["first"]
        assert first.error_kind == "model_error" and "FAKE scheduling fault" in str(first.error)
        worker.submit(answers.job("next", max_tokens=3))
        answers.wait_for("next")
        assert answers.outcomes["next"][0].outputs[0].text == " w0 w1 w2"
        assert all(i.seq_id != 0 for step in engine.steps for i in step)  # first never ran
    finally:
        assert worker.stop(timeout_s=GUARD_S)


def test_waiting_past_the_deadline_is_answered_504_and_never_runs(setup, clock):
    worker, answers, steps = setup(gated=True, max_running=1)
    worker.submit(answers.job("running", max_tokens=30))
    worker.submit(answers.job("late", max_tokens=2, timeout_s=0.05))
    steps.allow(0)  # running holds the only slot; late waits
    clock.advance(0.04)
    steps.allow(1)
    assert answers.order == []  # 0.04 s waited: not yet
    clock.advance(0.02)
    steps.allow(1)  # the next step is scheduled 0.06 s after late came: it expires
    assert answers.order == ["late"]  # answered while running decodes on
    [late] = answers.outcomes["late"]
    assert late.error_kind == "timeout" and "waited 0.1 s in the queue, past its deadline of 0.05 s" in str(late.error)
    assert late.queue_s == pytest.approx(0.06)
    steps.open()
    answers.wait_for("running")
    assert answers.outcomes["running"][0].outputs[0].completion_tokens == 30
    assert all(i.seq_id != 1 for step in steps.steps for i in step)  # late never ran


def test_cancel_takes_a_waiting_job_out_but_not_a_running_one(setup):
    worker, answers, steps = setup(gated=True, max_running=1)
    running = worker.submit(answers.job("running", max_tokens=20))
    waiting = worker.submit(answers.job("waiting", max_tokens=2))
    steps.allow(0)  # running is admitted and holds the only slot
    assert worker.cancel(waiting) is True
    assert worker.cancel(running) is False  # it runs on and is answered
    steps.open()
    answers.wait_for("running")
    assert answers.outcomes["running"][0].outputs[0].completion_tokens == 20
    eventually(lambda: worker.idle, "the worker never went idle")
    assert "waiting" not in answers.outcomes and worker.depth == 0
    assert all(i.seq_id != 1 for step in steps.steps for i in step)  # waiting never ran


def test_queue_limit_and_a_request_that_can_never_fit(setup):
    worker, answers, steps = setup(gated=True, step_s=1.0, max_running=1, max_queue=2, kv_blocks=4, block_size=4)
    worker.submit(answers.job("q0", max_tokens=2))
    steps.allow(0)  # q0 runs
    for i in (1, 2):
        worker.submit(answers.job(f"q{i}", max_tokens=2))  # they wait
    assert worker.depth == 2
    with pytest.raises(QueueFull):
        worker.submit(answers.job("refused", max_tokens=2))
    with pytest.raises(PayloadTooLarge, match="needs 17 tokens of KV cache; the whole cache holds 16"):
        worker.submit(answers.job("huge", max_tokens=17))
    assert worker.retry_after_s() == 1  # at least 1 s, before any request took a measurable time
    steps.allow(2)  # q0's two steps of 1 s each; q1 is admitted, q2 waits
    assert answers.order == ["q0"] and answers.outcomes["q0"][0].compute_s == 2.0 and worker.depth == 1
    assert worker.retry_after_s() == 4  # (1 waiting / 1 running + 1) rounds of 2 s
    steps.open()
    answers.wait_for("q0", "q1", "q2")
    assert answers.order == ["q0", "q1", "q2"]  # the refused ones are never answered


def test_kv_pressure_preempts_and_the_preempted_sequence_still_gets_its_whole_answer(setup):
    # 3 blocks of 4 tokens for two sequences that each grow to 9 tokens: one must be preempted
    worker, answers, _ = setup(start=False, max_running=2, kv_blocks=3, block_size=4)
    reports = []
    worker.hooks.on_step = reports.append
    worker.submit(answers.job("a", max_tokens=8))
    worker.submit(answers.job("b", max_tokens=8))
    worker.start()  # both are queued: the first step admits both
    answers.wait_for("a", "b")
    assert sum(r.preempted for r in reports) >= 1
    for name in "ab":
        assert answers.outcomes[name][0].outputs[0].text == "".join(f" w{i}" for i in range(8))


def test_stop_finishes_what_is_queued_then_refuses_more(setup):
    worker, answers, _ = setup(max_running=1)
    for name in ("one", "two"):
        worker.submit(answers.job(name, max_tokens=3))
    assert worker.stop(timeout_s=GUARD_S)
    assert answers.order == ["one", "two"]
    assert [o.outputs[0].text for name in answers.order for o in answers.outcomes[name]] == [" w0 w1 w2"] * 2
    with pytest.raises(ShuttingDown):
        worker.submit(answers.job("late"))


class ForkingSteps(FakeStepEngine):
    """FAKE: an engine that forks a choice's KV by sequence (as llama.cpp's does): records each fork."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.forks: list[tuple[int, int, int]] = []

    def fork(self, parent_seq_id: int, child_seq_id: int, n_tokens: int) -> None:
        self.forks.append((parent_seq_id, child_seq_id, n_tokens))


def test_two_hundred_requests_of_three_choices_leave_nothing_behind_in_the_worker(clock):
    """Each n=3 request queues two choices after its first prefilled; admitted, each forks the
    first's KV. Afterwards no sequence, row or fork link is held anywhere in the worker."""
    import gc

    fake = FakeGenerationEngine(name="fake")
    engine = ForkingSteps(fake)
    config = SchedulerConfig(max_running=32, max_step_tokens=64, kv_blocks=256, block_size=4)
    worker = ContinuousWorker(engine, config, decode=fake.decode, eos_ids=(), clock=clock)
    worker.start()
    outcomes: dict[int, JobOutcome] = {}
    wave_done = threading.Event()

    def done(i: int, outcome: JobOutcome) -> None:
        outcomes[i] = outcome
        if len(outcomes) % 10 == 0:
            wave_done.set()

    jobs: list[Job] = []
    try:
        for wave in range(20):  # 10 requests at a time: their choices join while the first still decodes
            wave_done.clear()
            for i in range(wave * 10, wave * 10 + 10):
                prompt = Prompt(ids=(word_id("tell"), word_id(f"story{i}")), prompt_tokens=2)
                params = SamplingParams(max_tokens=3, temperature=0)
                first = GenUnit(prompt=prompt, params=params, on_text=lambda t: None)
                others = [GenUnit(prompt=prompt, params=params, fork_of=first, on_text=lambda t: None) for _ in "ab"]
                job = Job(key="generate", units=[first, *others], run=lambda units: [], done=lambda o, i=i: done(i, o))
                worker.submit(job)
                jobs.append(job)
            assert wave_done.wait(GUARD_S), f"wave {wave}: {len(outcomes)} of {wave * 10 + 10} answered"
    finally:
        assert worker.stop(timeout_s=GUARD_S)
    bad = {i: o.error or [c.text for c in o.outputs] for i, o in outcomes.items() if not o.ok or len(o.outputs) != 3}
    assert not bad and all([c.text for c in o.outputs] == [" w0 w1 w2"] * 3 for o in outcomes.values()), bad
    assert len(engine.forks) == 400 and all(n == 1 for _, _, n in engine.forks)  # 2 choices x 200, 1 shared token
    assert worker.idle and worker._scheduler.sequences() == []
    assert sorted(set(engine.released)) == list(range(600))  # every sequence's engine state freed
    gc.collect()
    kept = [o for o in gc.get_objects() if type(o) is JobRun and any(o.job is j for j in jobs)]
    assert kept == []  # no job run (with its rows, sequences and fork links) outlives its answer


def test_work_between_steps_runs_on_the_worker_thread_after_the_step_never_beside_it(setup):
    """`between_steps` (a chat's image preprocessing) runs on the worker's own thread: at once
    when it is idle, after the step under way when it is busy; its error reaches the caller, a
    call cancelled before its turn never runs, and after `stop` it is refused (503)."""
    worker, answers, steps = setup(gated=True)
    seen: list[tuple[str, int]] = []

    def chore(name: str):
        def run() -> str:
            seen.append((threading.current_thread().name, steps.entered))
            return name

        return run

    assert worker.between_steps(chore("idle")).result(GUARD_S) == "idle"  # no step: it runs at once
    worker.submit(answers.job("long", max_tokens=4))
    steps.allow(0)  # step 1 holds at the gate: the worker thread is inside the engine's step
    busy = worker.between_steps(chore("busy"))
    gone = worker.between_steps(chore("gone"))
    assert gone.cancel()  # its request went away before its turn
    assert not busy.done()
    steps.allow(1)  # step 1 ends; the worker runs the call, then holds at step 2's gate
    assert busy.result(GUARD_S) == "busy"
    assert seen == [("accelab-continuous-worker", 0), ("accelab-continuous-worker", 1)]

    def broken() -> None:
        raise ValueError("not an image")

    failed = worker.between_steps(broken)
    steps.open()
    with pytest.raises(ValueError, match="not an image"):
        failed.result(GUARD_S)
    answers.wait_for("long")
    assert worker.stop(timeout_s=GUARD_S)
    with pytest.raises(ShuttingDown):
        worker.between_steps(chore("late"))
    assert [name for name, _ in seen] == ["accelab-continuous-worker"] * 2  # "gone" never ran


class EncodingSteps(GatedSteps):
    """FAKE: gated steps of a vision-language engine that encodes images between the steps
    (`EncodesAhead`): a picture is ready after one `encode_ahead` call; every step, encoder call
    and between-steps call is logged in order."""

    encodes_ahead = True

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.ready: set[str] = set()
        self.log: list[str] = []
        self.begun: list[StepInput] = []  # the inputs of the step begun last (it may hold at the gate)

    def step(self, inputs: list[StepInput]) -> list[int]:
        self.begun = list(inputs)
        out = super().step(inputs)
        self.log.append(f"step {self.entered}")
        return out

    def image_ready(self, key: Any) -> bool:
        return key in self.ready

    def encode_ahead(self, wanted: Any, budget_s: Any, *, batch: int = 1, interrupt: Any = None) -> dict:
        self.log.append("encode")
        self.ready.update(image.key for _, image in wanted)
        return {}


@pytest.fixture
def picture_step(clock):
    """A started worker over `EncodingSteps` (gated) whose step 1 holds at the gate: it feeds a
    picture chat's "look", whose prefill then waits for its picture's encoding."""
    from accelab.serve.runner.vision import ImageInput

    fake = FakeGenerationEngine(name="fake")
    steps = EncodingSteps(fake, clock=clock)
    limits = SchedulerConfig(max_running=4, max_step_tokens=64, kv_blocks=64, block_size=4, prefix_caching=True)
    worker = ContinuousWorker(steps, limits, decode=fake.decode, eos_ids=(), clock=clock)
    worker.start()
    answers = Answers()
    picture = answers.job("picture", "look", "at", "this", max_tokens=2)
    unit = picture.units[0]
    image = ImageInput(key="pic", positions=(1, 2), inputs={})  # "at this" are its placeholder tokens
    unit.prompt = replace(unit.prompt, media=(image,))
    worker.submit(picture)
    steps.allow(0)
    yield worker, steps, answers
    steps.open()
    assert worker.stop(timeout_s=GUARD_S)


def test_a_text_prompt_due_after_a_step_goes_before_the_image_work_but_holds_it_one_step_at_most(picture_step):
    """After a step, while a text prompt waits for its first token, the encoder's slice and the
    image preprocessing wait for the step that prefills it; the next step's image work runs even
    if another text prompt is due by then (the images are never held two steps in a row)."""
    worker, steps, answers = picture_step
    worker.submit(answers.job("text", "hello"))  # arrives during step 1
    chore = worker.between_steps(lambda: steps.log.append("prepare"))
    steps.allow(1)  # step 1 ends with "text" due: no encoding, no preparing; step 2 prefills "text"
    assert steps.log == ["step 1"] and not chore.done()
    assert [item.tokens for item in steps.begun] == [(word_id("hello"),)]
    worker.submit(answers.job("text2", "hi"))  # due after step 2 as well
    steps.allow(1)  # held once already: the image work runs after step 2
    assert steps.log == ["step 1", "step 2", "prepare", "encode"]
    steps.open()
    answers.wait_for("picture", "text", "text2")
    assert all(o.error is None for outcomes in answers.outcomes.values() for o in outcomes)


def test_a_text_prompt_that_arrives_while_requests_are_prepared_still_goes_before_the_encoder(picture_step):
    """A text prompt that comes in while the worker prepares an image request between the steps
    (not yet due when the step ended) still gets the next step before the encoder's slice."""
    worker, steps, answers = picture_step

    def prepare() -> None:  # the text request arrives meanwhile
        steps.log.append("prepare")
        worker.submit(answers.job("text", "hello"))

    worker.between_steps(prepare)
    steps.allow(1)  # step 1 ends with nothing due: the worker prepares, then "text" is due
    assert steps.log == ["step 1", "prepare"]
    assert [item.tokens for item in steps.begun] == [(word_id("hello"),)]
    steps.allow(1)
    assert steps.log == ["step 1", "prepare", "step 2", "encode"]
    steps.open()
    answers.wait_for("picture", "text")
