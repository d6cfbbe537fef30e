"""The serving worker of `--plan vllm` against a FAKE engine client (scripted token messages,
labelled FAKE in test_vllm_units) and a fake clock: the same contract as the continuous worker,
with vLLM doing the scheduling. The real engine behind real HTTP is tests/test_engine_process_serve.py."""

from __future__ import annotations

import time

import pytest
from test_vllm_units import FakeClient

from accelab.backends import engine_wire as W
from accelab.serve.batcher import QueueFull
from accelab.serve.engines.base import GenUnit, PayloadTooLarge, Prompt, SamplingParams
from accelab.serve.engines.vllm_worker import VllmWorker
from accelab.serve.jobs import Job, ShuttingDown

EOS = 2
WORDS = {10: "a", 11: " b", 12: " c", 13: " STOP", 14: " d"}


def decode(ids):
    return "".join(WORDS.get(i, "") for i in ids)


def make(clock, **client):
    fake = FakeClient(**client)
    worker = VllmWorker(fake, max_queue=3, decode=decode, eos_ids=[EOS], clock=clock)
    worker.start()
    return fake, worker


def job(*units, timeout_s=30.0):
    outcomes, started = [], []
    j = Job(
        key="generate",
        units=list(units),
        run=lambda u: [],
        done=outcomes.append,
        started=lambda: started.append(True),
        timeout_s=timeout_s,
    )
    return j, outcomes, started


def unit(ids=(1, 2, 3), max_tokens=4, stop=()):
    return GenUnit(
        prompt=Prompt(ids=tuple(ids), prompt_tokens=len(ids)),
        params=SamplingParams(max_tokens=max_tokens, temperature=0, stop=stop),
    )


def wait_for(condition, timeout_s=2.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_tokens_stream_as_text_and_the_job_completes_once(clock):
    fake, worker = make(clock)
    u = unit(max_tokens=3)
    texts = []
    u.on_text = texts.append
    j, outcomes, started = job(u)
    worker.submit(j)
    assert fake.sent[0].prompt_ids == [1, 2, 3] and fake.sent[0].max_tokens == 3 and worker.depth == 1
    fake.deliver("0", [10])
    assert started == [True] and worker.depth == 0
    clock.advance(0.5)
    fake.deliver("0", [11, 12])  # max_tokens reached: accelab ends it and tells vLLM
    assert "".join(texts) == "a b c" and len(outcomes) == 1
    done = outcomes[0].outputs[0]
    assert (done.text, done.finish_reason, done.completion_tokens, done.prompt_tokens) == ("a b c", "length", 3, 3)
    assert fake.aborted == ["0"] and worker.idle


def test_a_stop_string_ends_the_row_and_aborts_it_in_vllm(clock):
    fake, worker = make(clock)
    j, outcomes, _ = job(unit(max_tokens=8, stop=(" STOP",)))
    worker.submit(j)
    fake.deliver("0", [10, 11, 13, 14])
    out = outcomes[0].outputs[0]
    assert out.text == "a b" and out.finish_reason == "stop" and fake.aborted == ["0"]


def test_vllms_own_end_of_sequence_finishes_with_stop(clock):
    fake, worker = make(clock)
    j, outcomes, _ = job(unit(max_tokens=8))
    worker.submit(j)
    fake.deliver("0", [10, EOS], finished="stop")
    out = outcomes[0].outputs[0]
    assert out.text == "a" and out.finish_reason == "stop"


def test_the_queue_limit_counts_rows_without_a_token_and_takes_all_of_a_job_or_none(clock):
    fake, worker = make(clock)
    worker.submit(job(unit(), unit())[0])
    with pytest.raises(QueueFull, match="2 sequences are waiting"):
        worker.submit(job(unit(), unit())[0])
    assert len(fake.sent) == 2
    fake.deliver("0", [10])
    worker.submit(job(unit(), unit())[0])  # one of the first job is running now: room for two
    assert worker.depth == 3 and worker.retry_after_s() >= 1


def test_a_row_that_cannot_fit_the_kv_cache_is_413(clock):
    _, worker = make(clock, kv_blocks=2, block_size=16)  # 32 tokens
    with pytest.raises(PayloadTooLarge, match="needs 34 tokens of KV cache; vLLM's holds 32"):
        worker.submit(job(unit(ids=range(30), max_tokens=4))[0])


def test_a_job_past_its_deadline_without_a_token_times_out_and_leaves_vllm(clock):
    fake, worker = make(clock)
    j, outcomes, _ = job(unit(), timeout_s=5)
    worker.submit(j)
    clock.advance(6)
    wait_for(lambda: outcomes)
    assert outcomes[0].error_kind == "timeout" and "past its deadline of 5 s" in str(outcomes[0].error)
    assert fake.aborted == ["0"] and worker.depth == 0


def test_a_client_gone_mid_stream_stops_its_row(clock):
    fake, worker = make(clock)
    u = unit(max_tokens=8)
    j, outcomes, _ = job(u)
    worker.submit(j)
    fake.deliver("0", [10])
    u.cancelled = True
    wait_for(lambda: outcomes)
    assert outcomes[0].error_kind == "cancelled" and fake.aborted == ["0"]
    fake.deliver("0", [11])  # late tokens of an aborted row change nothing
    assert len(outcomes) == 1


def test_cancel_takes_back_only_a_job_without_tokens(clock):
    fake, worker = make(clock)
    queued, _, _ = job(unit())
    running, _, _ = job(unit())
    run_q, run_r = worker.submit(queued), worker.submit(running)
    fake.deliver("1", [10])
    assert worker.cancel(run_q) is True and worker.cancel(run_r) is False
    assert fake.aborted == ["0"] and worker.depth == 0


def test_an_engine_error_fails_only_its_job(clock):
    fake, worker = make(clock)
    bad, bad_out, _ = job(unit())
    good, good_out, _ = job(unit(max_tokens=1))
    worker.submit(bad)
    worker.submit(good)
    fake.handlers["0"](W.Failed(id="0", error="FAKE engine error"))
    fake.deliver("1", [10])
    assert bad_out[0].error_kind == "model_error" and "FAKE engine error" in str(bad_out[0].error)
    assert good_out[0].outputs[0].text == "a"


def test_stop_drains_and_refuses_new_work(clock):
    fake, worker = make(clock)
    j, outcomes, _ = job(unit(max_tokens=1))
    worker.submit(j)
    assert worker.stop(timeout_s=0.05) is False  # still running
    with pytest.raises(ShuttingDown):
        worker.submit(job(unit())[0])
    fake.deliver("0", [10])
    assert worker.stop(timeout_s=1) is True and outcomes[0].ok


def test_each_vllm_step_reports_its_figures(clock):
    fake, worker = make(clock, kv_blocks=100)
    reports = []
    worker.hooks.on_step = reports.append
    worker.submit(job(unit())[0])
    fake.deliver("0", [10, 11])
    clock.advance(0.02)
    fake.on_stats(W.Stats(running=1, waiting=0, kv_usage=0.25, preempted=1, prefix_hit_tokens=16))
    r = reports[0]
    assert (r.running, r.waiting, r.kv_used, r.kv_free, r.sampled, r.preempted, r.reused_tokens) == (
        1,
        0,
        25,
        75,
        2,
        1,
        16,
    )
    assert r.seconds == pytest.approx(0.02) and r.batch == 1
