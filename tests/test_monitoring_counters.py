"""Retries counted where they happen, and vLLM's names, with FAKE engines (tests/fakes_serve.py)
behind the real app: a continuous step that fails is run again sequence by sequence (one split
counted), a preempted sequence's tokens are counted as recomputed, per-sequence histograms and
finish reasons fill, and `--metric-aliases vllm` exports vLLM's families from the same series
(the Ray front's own counters merged beside the replicas')."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fakes_serve import FakeGenerationEngine
from prometheus_client.parser import text_string_to_metric_families
from serving import running_server

from accelab.serve.app import create_app
from accelab.serve.config import ServeConfig
from accelab.serve.metrics import FrontMetrics, ServeMetrics
from accelab.serve.replica_front import merge_metrics


def serve(engine, **config):
    config.setdefault("model_name", "fake")
    return running_server(create_app(ServeConfig(**config), lambda: engine, stop_timeout_s=5))


def metric(url: str, name: str, **labels: str) -> float:
    wanted = tuple(sorted(labels.items()))
    return samples(httpx.get(f"{url}/metrics").text)[(name, wanted)]


async def post_many(url: str, path: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        return await asyncio.gather(*(client.post(path, json=b) for b in bodies))


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_a_failing_continuous_step_is_split_and_counted_once():
    with serve(FakeGenerationEngine(name="fake", delay_s=0.001)) as url:
        # two prompts of one request are admitted in one step; "boom" fails it (a FAKE model error)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": ["a b", "boom"], "max_tokens": 3})
        assert r.status_code == 500
        assert metric(url, "accelab_batch_retries_total", reason="batch_error") == 1
        assert metric(url, "accelab_errors_total", kind="model_error") == 1
        ok = httpx.post(f"{url}/v1/completions", json={"prompt": "a b", "max_tokens": 3})
        assert ok.status_code == 200
        assert metric(url, "accelab_batch_retries_total", reason="batch_error") == 1  # a lone sequence: no split


def test_preempted_sequences_count_their_tokens_and_every_step_its_batch():
    # a KV cache of 2 blocks of 16 tokens and two sequences of 1 prompt token growing to 21: when
    # the oldest needs a third block, the youngest (1 + 16 tokens by then) is preempted
    with serve(FakeGenerationEngine(name="fake", delay_s=0.001), kv_cache_tokens=32) as url:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 20})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 40
        preemptions = metric(url, "accelab_preemptions_total")
        assert preemptions >= 1
        assert metric(url, "accelab_preempted_tokens_total") == 17 * preemptions
        steps = metric(url, "accelab_batch_size_count")
        assert steps >= 20 and metric(url, "accelab_batch_size_bucket", le="2.0") == steps  # never 3 at once
        assert metric(url, "accelab_request_generation_tokens_count") == 2
        assert metric(url, "accelab_request_generation_tokens_sum") == 40
        assert metric(url, "accelab_request_max_tokens_sum") == 40
        assert metric(url, "accelab_finished_sequences_total", finish_reason="length") == 2
        assert metric(url, "accelab_request_decode_seconds_count") == 2


def test_vllm_names_only_when_asked_and_from_the_same_series():
    with serve(FakeGenerationEngine(name="fake", delay_s=0.001)) as url:
        assert "vllm:" not in httpx.get(f"{url}/metrics").text
    with serve(
        FakeGenerationEngine(name="fake", delay_s=0.001), model_name="my-llm", metric_aliases="vllm", kv_cache_tokens=64
    ) as url:
        bodies = [{"messages": [{"role": "user", "content": "a b"}], "max_tokens": 3}] * 3
        assert [r.status_code for r in asyncio.run(post_many(url, "/v1/chat/completions", bodies))] == [200] * 3
        httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 2})
        got = samples(httpx.get(f"{url}/metrics").text)
    model = (("model_name", "my-llm"),)
    assert got[("vllm:e2e_request_latency_seconds_count", model)] == 4  # chat and completions, summed
    assert got[("vllm:e2e_request_latency_seconds_count", model)] == sum(
        v
        for (n, labels), v in got.items()
        if n == "accelab_request_latency_seconds_count" and dict(labels)["route"] in ("chat", "completions")
    )
    assert got[("vllm:generation_tokens_total", model)] == got[("accelab_generated_tokens_total", ())] == 11
    assert got[("vllm:request_success_total", (("finished_reason", "length"), *model))] == 4
    assert got[("vllm:kv_cache_usage_perc", model)] == got[("vllm:gpu_cache_usage_perc", model)] == 0.0
    assert got[("vllm:num_requests_running", model)] == 0
    assert got[("vllm:request_max_num_generation_tokens_sum", model)] == 3 * 3 + 2


def test_kv_usage_is_a_fraction_and_the_aliases_survive_the_replica_merge():
    a = ServeMetrics()
    a.configure(max_queue=8, model_name="m", aliases="vllm")
    a.kv_blocks.labels(state="used").set(3)
    a.kv_blocks.labels(state="free").set(1)
    front = FrontMetrics(configured=2)
    front.replica_retries.inc(3)
    front.replica_lost.labels(when="mid_stream").inc()
    merged = samples(merge_metrics({"r1": (a.render().decode(), 11)}, front).decode())
    assert merged[("vllm:kv_cache_usage_perc", (("model_name", "m"), ("replica", "r1")))] == 0.75
    assert merged[("accelab_queue_limit", (("replica", "r1"),))] == 8
    assert merged[("accelab_replicas_configured", ())] == 2  # the front's own, without a replica label
    assert merged[("accelab_replica_retries_total", ())] == 3
    assert merged[("accelab_replica_lost_requests_total", (("when", "mid_stream"),))] == 1
    assert merged[("accelab_replica_lost_requests_total", (("when", "before_answer"),))] == 0


def test_a_wrong_alias_choice_says_what_is_allowed():
    with pytest.raises(ValueError, match=r"metric_aliases='prom' is not one of none, vllm \(--metric-aliases vllm"):
        ServeConfig(model_name="m", metric_aliases="prom")  # type: ignore[arg-type]  # wrong, on purpose
