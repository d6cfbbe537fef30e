"""The model worker thread with FAKE engines: OOM split-and-retry, one bad input failing alone,
deadlines, exactly one answer per job."""

from __future__ import annotations

import threading
import time

import pytest
from fakes_serve import FakeEmbeddingEngine, FakeModelError

from accelab.serve.batcher import BatchPolicy
from accelab.serve.jobs import Job, JobOutcome
from accelab.serve.worker import Worker, WorkerHooks


class Collector:
    def __init__(self) -> None:
        self.outcomes: dict[str, list[JobOutcome]] = {}
        self.lock = threading.Lock()
        self.all_done = threading.Event()
        self.expected = 0

    def done_for(self, name: str):
        def done(outcome: JobOutcome) -> None:
            with self.lock:
                self.outcomes.setdefault(name, []).append(outcome)
                if sum(map(len, self.outcomes.values())) == self.expected:
                    self.all_done.set()

        return done


def submit_all(worker: Worker, engine: FakeEmbeddingEngine, texts: dict[str, str], *, timeout_s=None) -> Collector:
    collector = Collector()
    collector.expected = len(texts)
    for name, text in texts.items():
        worker.submit(
            Job(
                key="embed",
                units=[engine.prepare_text(text)],
                run=engine.embed,
                done=collector.done_for(name),
                timeout_s=timeout_s,
            )
        )
    return collector


def test_oom_splits_the_batch_retries_and_lowers_the_limit():
    engine = FakeEmbeddingEngine(name="fake", oom_above=2)
    retries = []
    worker = Worker(BatchPolicy(max_batch_size=8, max_wait_s=0.2), hooks=WorkerHooks(on_retry=retries.append))
    collector = submit_all(worker, engine, {f"r{i}": f"text number {i}" for i in range(8)})
    worker.start()  # all 8 are queued before the worker looks: one batch of 8
    try:
        assert collector.all_done.wait(10)
        assert all(len(o) == 1 and o[0].ok for o in collector.outcomes.values())
        assert engine.batches[0] == 8
        # 8 fails -> limit 4; its first 4 fail -> limit 2; the rest runs in twos
        assert engine.batches == [8, 4, 2, 2, 2, 2]
        assert retries == ["oom"] * 2
        assert worker.batch_limit == 2  # the next batch tries 2
        collector = submit_all(worker, engine, {f"again{i}": f"more {i}" for i in range(4)})
        assert collector.all_done.wait(10)
        assert engine.batches[6:] == [2, 2]
    finally:
        worker.stop(timeout_s=5)


def test_one_bad_input_fails_alone():
    engine = FakeEmbeddingEngine(name="fake")
    retries = []
    worker = Worker(BatchPolicy(max_batch_size=8, max_wait_s=0.2), hooks=WorkerHooks(on_retry=retries.append))
    texts = {"a": "good one", "b": "this goes boom", "c": "also good", "d": "fine"}
    collector = submit_all(worker, engine, texts)
    worker.start()
    try:
        assert collector.all_done.wait(10)
        assert engine.batches == [4, 1, 1, 1, 1]
        assert retries == ["batch_error"]
        bad = collector.outcomes["b"][0]
        assert not bad.ok and isinstance(bad.error, FakeModelError) and bad.error_kind == "model_error"
        for name in "acd":
            [outcome] = collector.outcomes[name]
            assert outcome.ok and len(outcome.outputs) == 1
    finally:
        worker.stop(timeout_s=5)


def test_expired_job_is_answered_once_and_never_run():
    engine = FakeEmbeddingEngine(name="fake", delay_s=0.5)
    worker = Worker(BatchPolicy(max_batch_size=1, max_wait_s=0.0))
    worker.start()
    try:
        first = submit_all(worker, engine, {"first": "busy"})
        time.sleep(0.05)  # the worker is now inside the first batch
        late = submit_all(worker, engine, {"late": "never runs"}, timeout_s=0.1)
        assert first.all_done.wait(5) and late.all_done.wait(5)
        [outcome] = late.outcomes["late"]
        assert outcome.error_kind == "timeout" and "deadline" in str(outcome.error)
        assert engine.batches == [1]  # only "first" ran
    finally:
        worker.stop(timeout_s=5)


def test_stop_runs_what_is_queued_then_ends():
    engine = FakeEmbeddingEngine(name="fake", delay_s=0.05)
    worker = Worker(BatchPolicy(max_batch_size=2, max_wait_s=10.0))  # would wait 10 s for company
    worker.start()
    collector = submit_all(worker, engine, {"a": "x", "b": "y", "c": "z"})
    assert worker.stop(timeout_s=5)
    assert collector.all_done.is_set()
    assert all(o[0].ok for o in collector.outcomes.values())
    with pytest.raises(Exception, match="shutting down"):
        submit_all(worker, engine, {"d": "too late"})
