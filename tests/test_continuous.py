"""The continuous worker (a real thread) over the FAKE step engine: joining and leaving the
running batch per step, failures that stay with their sequence, cancellation, deadlines."""

from __future__ import annotations

import threading
import time

import pytest
from fakes_serve import POISON, FakeGenerationEngine, FakeStepEngine, word_id

from accelab.serve.batcher import QueueFull
from accelab.serve.continuous import ContinuousWorker
from accelab.serve.engines.base import GenUnit, PayloadTooLarge, Prompt, SamplingParams
from accelab.serve.scheduler import SchedulerConfig
from accelab.serve.worker import Job, JobOutcome


class Answers:
    """Collects every `done` call, in order, with the time it came."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.outcomes: dict[str, list[JobOutcome]] = {}
        self.event = threading.Event()

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
            self.order.append(name)
            self.outcomes.setdefault(name, []).append(outcome)
            self.event.set()

        return Job(key="generate", units=[unit], run=lambda units: [], done=done, timeout_s=timeout_s)

    def wait_for(self, *names: str, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(n in self.outcomes for n in names):
            assert time.monotonic() < deadline, f"no answer for {set(names) - set(self.outcomes)}"
            self.event.wait(0.05)
            self.event.clear()


@pytest.fixture
def setup():
    made = []

    def build(delay_s: float = 0.002, **limits) -> tuple[ContinuousWorker, Answers]:
        fake = FakeGenerationEngine(name="fake", delay_s=delay_s)
        limits = {"max_running": 4, "max_step_tokens": 64, "kv_blocks": 64, "block_size": 4, **limits}
        worker = ContinuousWorker(fake.step_engine(None), SchedulerConfig(**limits), decode=fake.decode, eos_ids=())
        worker.start()
        made.append(worker)
        return worker, Answers()

    yield build
    for worker in made:
        assert worker.stop(timeout_s=10)


def test_a_short_request_sent_later_finishes_first_and_tokens_stream_one_by_one(setup):
    worker, answers = setup(delay_s=0.01)
    pieces: list[str] = []
    worker.submit(answers.job("long", max_tokens=40))
    time.sleep(0.05)  # long is decoding
    worker.submit(answers.job("short", max_tokens=3, pieces=pieces))
    answers.wait_for("long", "short")
    assert answers.order == ["short", "long"]
    assert answers.outcomes["short"][0].outputs[0].text == " w0 w1 w2"
    assert pieces == [" w0", " w1", " w2"]  # one piece per step, not one at the end
    long = answers.outcomes["long"][0].outputs[0]
    assert long.completion_tokens == 40 and long.finish_reason == "length"
    # short joined the running batch: some step carried both sequences
    assert any(len(step) == 2 for step in worker.engine.steps)


def test_a_failing_sequence_fails_alone_and_every_job_gets_one_answer(setup):
    worker, answers = setup()
    worker.submit(answers.job("good1", max_tokens=6))
    worker.submit(answers.job("bad", POISON, max_tokens=6))
    worker.submit(answers.job("good2", max_tokens=6))
    answers.wait_for("good1", "bad", "good2")
    assert [o.outputs[0].text for o in answers.outcomes["good1"] + answers.outcomes["good2"]] == [
        " w0 w1 w2 w3 w4 w5"
    ] * 2
    [bad] = answers.outcomes["bad"]
    assert bad.error_kind == "model_error" and "FAKE model error" in str(bad.error)
    assert all(len(v) == 1 for v in answers.outcomes.values())
    time.sleep(0.05)
    assert worker.idle and set(worker.engine.released) == {0, 1, 2}  # every sequence's KV freed


def test_a_client_that_goes_away_frees_its_slot_and_kv_at_the_next_step(setup):
    worker, answers = setup(delay_s=0.01, max_running=1)
    job = answers.job("gone", max_tokens=200)
    worker.submit(job)
    worker.submit(answers.job("next", max_tokens=2))
    time.sleep(0.05)
    assert worker.depth == 1  # `next` waits for the only slot
    job.units[0].cancelled = True  # what the route does when the stream's client leaves
    answers.wait_for("gone", "next")
    assert answers.outcomes["gone"][0].error_kind == "cancelled"
    assert answers.outcomes["next"][0].outputs[0].text == " w0 w1"
    assert 0 in worker.engine.released
    gone_steps = sum(1 for step in worker.engine.steps if any(i.seq_id == 0 for i in step))
    assert gone_steps < 30  # it stopped long before its 200 tokens


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


def test_a_fault_while_scheduling_fails_the_held_requests_and_the_worker_serves_the_next():
    fake = FakeGenerationEngine(name="fake", delay_s=0.002)
    engine = FaultyReuse(fake)
    config = SchedulerConfig(max_running=4, max_step_tokens=64, kv_blocks=64, block_size=4)
    worker = ContinuousWorker(engine, config, decode=fake.decode, eos_ids=())
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
    finally:
        assert worker.stop(timeout_s=10)


def test_waiting_past_the_deadline_is_answered_504_and_never_runs(setup):
    worker, answers = setup(delay_s=0.01, max_running=1)
    worker.submit(answers.job("running", max_tokens=30))
    worker.submit(answers.job("late", max_tokens=2, timeout_s=0.05))
    answers.wait_for("late")
    [late] = answers.outcomes["late"]
    assert late.error_kind == "timeout" and "past its deadline of 0.05 s" in str(late.error)
    assert all(i.seq_id != 1 for step in worker.engine.steps for i in step)
    answers.wait_for("running")


def test_cancel_takes_a_waiting_job_out_but_not_a_running_one(setup):
    worker, answers = setup(delay_s=0.01, max_running=1)
    running = worker.submit(answers.job("running", max_tokens=20))
    waiting = worker.submit(answers.job("waiting", max_tokens=2))
    time.sleep(0.05)
    assert worker.cancel(waiting) is True
    assert worker.cancel(running) is False  # it runs on and is answered
    answers.wait_for("running")
    assert "waiting" not in answers.outcomes and worker.depth == 0


def test_queue_limit_and_a_request_that_can_never_fit(setup):
    worker, answers = setup(delay_s=0.05, max_running=1, max_queue=2, kv_blocks=4, block_size=4)
    worker.submit(answers.job("q0", max_tokens=2))
    time.sleep(0.02)  # q0 runs
    for i in (1, 2):
        worker.submit(answers.job(f"q{i}", max_tokens=2))  # they wait
    with pytest.raises(QueueFull):
        worker.submit(answers.job("refused", max_tokens=2))
    with pytest.raises(PayloadTooLarge, match="needs 17 tokens of KV cache; the whole cache holds 16"):
        worker.submit(answers.job("huge", max_tokens=17))
    assert worker.retry_after_s() >= 1
    answers.wait_for("q0", "q1", "q2")


def test_kv_pressure_preempts_and_the_preempted_sequence_still_gets_its_whole_answer(setup):
    # 3 blocks of 4 tokens for two sequences that each grow to 9 tokens: one must be preempted
    worker, answers = setup(max_running=2, kv_blocks=3, block_size=4)
    reports = []
    worker.hooks.on_step = reports.append
    worker.submit(answers.job("a", max_tokens=8))
    worker.submit(answers.job("b", max_tokens=8))
    answers.wait_for("a", "b")
    assert sum(r.preempted for r in reports) >= 1
    for name in "ab":
        assert answers.outcomes[name][0].outputs[0].text == "".join(f" w{i}" for i in range(8))


def test_stop_finishes_what_is_queued_then_refuses_more(setup):
    worker, answers = setup(delay_s=0.005, max_running=1)
    for name in ("one", "two"):
        worker.submit(answers.job(name, max_tokens=3))
    assert worker.stop(timeout_s=10)
    assert answers.order == ["one", "two"]
    from accelab.serve.worker import ShuttingDown

    with pytest.raises(ShuttingDown):
        worker.submit(answers.job("late"))


class ForkingSteps(FakeStepEngine):
    """FAKE: an engine that forks a choice's KV by sequence (as llama.cpp's does): records each fork."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.forks: list[tuple[int, int, int]] = []

    def fork(self, parent_seq_id: int, child_seq_id: int, n_tokens: int) -> None:
        self.forks.append((parent_seq_id, child_seq_id, n_tokens))


def test_two_hundred_requests_of_three_choices_leave_nothing_behind_in_the_worker():
    """Each n=3 request queues two choices after its first prefilled; admitted, each forks the
    first's KV. Afterwards no sequence, row or fork link is held anywhere in the worker."""
    import gc

    fake = FakeGenerationEngine(name="fake", delay_s=0.0)
    engine = ForkingSteps(fake)
    config = SchedulerConfig(max_running=32, max_step_tokens=64, kv_blocks=256, block_size=4)
    worker = ContinuousWorker(engine, config, decode=fake.decode, eos_ids=())
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
            assert wave_done.wait(30), f"wave {wave}: {len(outcomes)} of {wave * 10 + 10} answered"
    finally:
        assert worker.stop(timeout_s=10)
    bad = {i: o.error or [c.text for c in o.outputs] for i, o in outcomes.items() if not o.ok or len(o.outputs) != 3}
    assert not bad and all([c.text for c in o.outputs] == [" w0 w1 w2"] * 3 for o in outcomes.values()), bad
    assert len(engine.forks) == 400 and all(n == 1 for _, _, n in engine.forks)  # 2 choices x 200, 1 shared token
    assert worker.idle and worker._scheduler.sequences() == []
    assert sorted(set(engine.released)) == list(range(600))  # every sequence's engine state freed
    gc.collect()
    kept = [o for o in gc.get_objects() if type(o).__name__ == "_JobRun" and any(o.job is j for j in jobs)]
    assert kept == []  # no job run (with its rows, sequences and fork links) outlives its answer
