"""The HTTP server with FAKE engines (in-process uvicorn on a free port): admission control,
limits, errors, auth, metrics, probes, streaming shape."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import struct
import threading
import time

import httpx
import pytest
import uvicorn
from fakes_serve import FakeEmbeddingEngine, FakeGenerationEngine
from serving import running_server

from accelab.serve.app import create_app
from accelab.serve.config import ServeConfig


def serve(engine, **config):
    config.setdefault("model_name", "fake")
    app = create_app(ServeConfig(**config), lambda: engine, stop_timeout_s=5)
    return running_server(app)


def metric(url: str, name: str, **labels) -> float:
    text = httpx.get(f"{url}/metrics").text
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{want} not in /metrics")


async def post_many(url: str, path: str, bodies: list[dict], **kw) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=len(bodies) + 5, max_keepalive_connections=len(bodies) + 5)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
        return await asyncio.gather(*(client.post(path, json=b, **kw) for b in bodies))


async def post_many_queued(url: str, path: str, bodies: list[dict]) -> list[httpx.Response]:
    """`bodies` all queued together: a first request occupies the model (the engine's delay)
    while they arrive, so they make one batch however the connections interleave. Without it a
    server that starts a lone request at once (nothing else on its way yet) may run the first
    body alone."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        blocker = asyncio.create_task(client.post(path, json={"input": "occupies the model"}))
        await asyncio.sleep(0.15)
        responses = await post_many(url, path, bodies)
        assert (await blocker).status_code == 200
        return responses


def test_flood_past_the_queue_gets_429_and_every_accepted_request_one_answer():
    engine = FakeEmbeddingEngine(name="fake", delay_s=0.3)
    with serve(engine, max_queue=4, max_batch_size=2, max_wait_ms=1) as url:
        bodies = [{"input": f"request {i}"} for i in range(40)]
        responses = asyncio.run(post_many(url, "/v1/embeddings", bodies))
        codes = [r.status_code for r in responses]
        assert set(codes) <= {200, 429}, codes
        ok = [r for r in responses if r.status_code == 200]
        refused = [r for r in responses if r.status_code == 429]
        assert refused and len(ok) >= 4
        assert all(int(r.headers["retry-after"]) >= 1 for r in refused)
        assert "at capacity" in refused[0].json()["error"]["message"]
        # every accepted request ran exactly once and got exactly one answer
        assert sum(engine.batches) == len(ok)
        assert max(engine.batches) <= 2
        assert metric(url, "accelab_errors_total", kind="queue_full") == len(refused)
        assert httpx.get(f"{url}/livez").status_code == 200  # and the server is still up
        assert httpx.post(f"{url}/v1/embeddings", json={"input": "after"}).status_code == 200


def test_expired_deadline_gets_504_and_is_not_run():
    engine = FakeEmbeddingEngine(name="fake", delay_s=1.0)
    with serve(engine, max_batch_size=1, max_wait_ms=0, request_timeout_s=0.3) as url:

        async def scenario():
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                first = asyncio.create_task(client.post("/v1/embeddings", json={"input": "occupies the model"}))
                await asyncio.sleep(0.1)
                started = time.monotonic()
                late = await client.post("/v1/embeddings", json={"input": "waits too long"})
                waited = time.monotonic() - started
                return await first, late, waited

        first, late, waited = asyncio.run(scenario())
        assert first.status_code == 200
        assert late.status_code == 504
        assert "--request-timeout" in late.json()["error"]["message"]
        assert waited < 0.9  # answered at its deadline, not after the busy batch
        time.sleep(1.0)
        assert engine.batches == [1]  # the late request never ran


def test_a_client_that_hangs_up_is_dropped_from_the_queue():
    engine = FakeEmbeddingEngine(name="fake", delay_s=1.0)
    with serve(engine, max_batch_size=1, max_wait_ms=0) as url:

        async def scenario():
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                first = asyncio.create_task(client.post("/v1/embeddings", json={"input": "occupies the model"}))
                await asyncio.sleep(0.1)
                with pytest.raises(httpx.ReadTimeout):  # gives up while queued behind "first"
                    await client.post("/v1/embeddings", json={"input": "impatient"}, timeout=0.3)
                return await first

        assert asyncio.run(scenario()).status_code == 200
        time.sleep(1.2)
        assert engine.batches == [1]  # the impatient request was never run
        assert metric(url, "accelab_errors_total", kind="client_gone") == 1


def test_oom_with_a_fake_model_splits_and_retries_over_http():
    engine = FakeEmbeddingEngine(name="fake", oom_above=2, delay_s=0.3)  # raises torch.OutOfMemoryError, labelled FAKE
    with serve(engine, max_batch_size=8, max_wait_ms=300) as url:
        responses = asyncio.run(post_many_queued(url, "/v1/embeddings", [{"input": f"text {i}"} for i in range(8)]))
        assert [r.status_code for r in responses] == [200] * 8
        assert engine.batches[:2] == [1, 8] and max(engine.batches[2:]) <= 4
        assert metric(url, "accelab_batch_retries_total", reason="oom") >= 1
        assert metric(url, "accelab_batch_size_limit") <= 2


def test_one_bad_request_in_a_batch_fails_alone():
    engine = FakeEmbeddingEngine(name="fake", delay_s=0.3)
    with serve(engine, max_batch_size=8, max_wait_ms=300) as url:
        bodies = [{"input": "fine"}, {"input": "this one goes boom"}, {"input": "also fine"}, {"input": "ok"}]
        responses = asyncio.run(post_many_queued(url, "/v1/embeddings", bodies))
        codes = [r.status_code for r in responses]
        assert codes == [200, 500, 200, 200]
        assert "FAKE model error" in responses[1].json()["error"]["message"]
        assert engine.batches == [1, 4, 1, 1, 1, 1]  # the blocker, the batch, then its inputs one by one
        assert metric(url, "accelab_batch_retries_total", reason="batch_error") == 1
        assert metric(url, "accelab_errors_total", kind="model_error") == 1


def test_api_key_required():
    with serve(FakeEmbeddingEngine(name="fake"), api_key="s3cret") as url:
        missing = httpx.post(f"{url}/v1/embeddings", json={"input": "x"})
        assert missing.status_code == 401
        assert "Authorization: Bearer" in missing.json()["error"]["message"]
        wrong = httpx.post(f"{url}/v1/embeddings", json={"input": "x"}, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        good = httpx.post(f"{url}/v1/embeddings", json={"input": "x"}, headers={"Authorization": "Bearer s3cret"})
        assert good.status_code == 200
        assert httpx.get(f"{url}/readyz").status_code == 200  # probes need no key
        assert httpx.get(f"{url}/v1/models").status_code == 401


def test_oversized_payloads_get_413():
    with serve(FakeGenerationEngine(name="fake"), max_body_bytes=2000, max_tokens=64, max_inputs=3) as url:
        big = httpx.post(f"{url}/v1/completions", json={"prompt": "x " * 2000})
        assert big.status_code == 413 and "2,000 bytes" in big.json()["error"]["message"]
        chunked = httpx.post(
            f"{url}/v1/completions",
            content=(c for c in [b'{"prompt": "', b"y" * 3000, b'"}']),
            headers={"content-type": "application/json"},
        )
        assert chunked.status_code == 413  # no content-length: counted while reading
        tokens = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 65})
        assert tokens.status_code == 413 and "--max-tokens" in tokens.json()["error"]["message"]
        many = httpx.post(f"{url}/v1/completions", json={"prompt": ["a", "b", "c", "d"]})
        assert many.status_code == 413 and "at most 3" in many.json()["error"]["message"]
        assert metric(url, "accelab_errors_total", kind="too_large") == 4


def test_invalid_requests_get_422_that_say_what_is_wrong():
    with serve(FakeGenerationEngine(name="fake")) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "robot", "content": "hi"}]})
        assert r.status_code == 422
        message = r.json()["error"]["message"]
        assert "messages.0.role" in message and "'robot'" in message and "'user'" in message
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": []})
        assert r.status_code == 422 and "messages" in r.json()["error"]["message"]
        r = httpx.post(
            f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "temperature": 5}
        )
        assert r.status_code == 422 and "temperature" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 422 and "JSON" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/embeddings", json={"input": "x"})
        assert r.status_code == 400 and "serves chat, completions" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/completions", json={"model": "gpt-4", "prompt": "x"})
        assert r.status_code == 404 and "'fake'" in r.json()["error"]["message"]


def test_readyz_is_503_until_the_model_is_loaded():
    release = threading.Event()

    def slow_factory():
        release.wait(20)  # the "load" ends when the test says so
        return FakeEmbeddingEngine(name="fake")

    app = create_app(ServeConfig(model_name="fake"), slow_factory)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while True:  # wait until it listens: /livez answers while the model loads
            try:
                assert httpx.get(f"{url}/livez").status_code == 200
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.02)
        loading = httpx.get(f"{url}/readyz")
        assert loading.status_code == 503 and loading.json()["status"] == "loading"
        early = httpx.post(f"{url}/v1/embeddings", json={"input": "x"})
        assert early.status_code == 503 and "loading" in early.json()["error"]["message"]
        assert early.headers["retry-after"]
        release.set()
        while httpx.get(f"{url}/readyz").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert httpx.post(f"{url}/v1/embeddings", json={"input": "x"}).status_code == 200
    finally:
        release.set()
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_embeddings_shape_float_and_base64():
    with serve(FakeEmbeddingEngine(name="fake")) as url:
        r = httpx.post(f"{url}/v1/embeddings", json={"input": ["one two", "three"]}).json()
        assert r["object"] == "list" and [d["index"] for d in r["data"]] == [0, 1]
        vector = r["data"][0]["embedding"]
        assert len(vector) == 8 and abs(sum(x * x for x in vector) - 1) < 1e-6
        assert r["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
        b = httpx.post(f"{url}/v1/embeddings", json={"input": ["one two"], "encoding_format": "base64"}).json()
        decoded = struct.unpack("<8f", base64.b64decode(b["data"][0]["embedding"]))
        assert max(abs(x - y) for x, y in zip(decoded, vector)) < 1e-6


def test_streaming_chat_one_id_usage_and_metrics():
    with serve(FakeGenerationEngine(name="fake", delay_s=0.01)) as url:
        body = {
            "messages": [{"role": "user", "content": "a b c"}],
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert len({c["id"] for c in chunks}) == 1
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        assert text == " w0 w1 w2 w3"
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
            "prompt_tokens": 3,
            "completion_tokens": 4,
            "total_tokens": 7,
        }
        assert metric(url, "accelab_generated_tokens_total") == 4
        assert metric(url, "accelab_time_to_first_token_seconds_count") == 1
        assert metric(url, "accelab_time_per_output_token_seconds_count") == 1
        text = httpx.get(f"{url}/metrics").text
        for name in (
            "accelab_queue_time_seconds_bucket",
            "accelab_compute_time_seconds_bucket",
            "accelab_batch_size_bucket",
            "accelab_queue_depth",
            "accelab_process_resident_memory_bytes",
        ):
            assert name in text


def test_streaming_error_after_start_travels_in_the_stream():
    with serve(FakeGenerationEngine(name="fake", delay_s=0.01)) as url:
        body = {"messages": [{"role": "user", "content": "boom"}], "max_tokens": 4, "stream": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert "FAKE model error" in json.loads(events[-2])["error"]["message"]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_completions_with_list_of_prompts_and_stop(temperature):
    with serve(FakeGenerationEngine(name="fake")) as url:
        r = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": ["a", "b c"], "max_tokens": 5, "stop": [" w3"], "temperature": temperature},
        ).json()
        assert [c["text"] for c in r["choices"]] == [" w0 w1 w2"] * 2
        assert [c["finish_reason"] for c in r["choices"]] == ["stop", "stop"]
        assert r["usage"]["prompt_tokens"] == 3


def test_generation_under_continuous_batching_queues_then_429s_and_504s():
    # one sequence runs at a time (max_batch_size 1); two may wait; more get 429 with Retry-After
    engine = FakeGenerationEngine(name="fake", delay_s=0.02)
    with serve(engine, max_batch_size=1, max_queue=2, request_timeout_s=30, max_step_tokens=8) as url:
        bodies = [{"messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 10} for i in range(8)]
        responses = asyncio.run(post_many(url, "/v1/chat/completions", bodies))
        codes = sorted(r.status_code for r in responses)
        assert set(codes) == {200, 429} and codes.count(200) >= 2  # two waiting, maybe one running
        refused = [r for r in responses if r.status_code == 429]
        assert all(int(r.headers["retry-after"]) >= 1 for r in refused)
        assert all(
            r.json()["choices"][0]["message"]["content"] == "".join(f" w{i}" for i in range(10))
            for r in responses
            if r.status_code == 200
        )
        assert metric(url, "accelab_errors_total", kind="queue_full") == len(refused)
        assert metric(url, "accelab_running_sequences") == 0  # all answered, none left running
    with serve(
        FakeGenerationEngine(name="fake", delay_s=0.05), max_batch_size=1, request_timeout_s=0.3, max_step_tokens=8
    ) as url:
        bodies = [{"messages": [{"role": "user", "content": "a"}], "max_tokens": 20}] * 3
        codes = sorted(r.status_code for r in asyncio.run(post_many(url, "/v1/chat/completions", bodies)))
        assert codes == [200, 504, 504]  # the first runs 1 s; the others wait past 0.3 s and never run


def test_a_request_that_could_never_fit_the_kv_cache_gets_413():
    with serve(FakeGenerationEngine(name="fake"), kv_cache_tokens=64, max_tokens=512) as url:
        r = httpx.post(
            f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "a b"}], "max_tokens": 100}
        )
        assert r.status_code == 413
        assert "needs 101 tokens of KV cache; the whole cache holds 64" in r.json()["error"]["message"]
        ok = httpx.post(
            f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "a b"}], "max_tokens": 8}
        )
        assert ok.status_code == 200 and metric(url, "accelab_kv_cache_blocks", state="free") == 4


@pytest.mark.parametrize("scheduler", ["continuous", "static"])
def test_both_schedulers_answer_the_same(scheduler):
    with serve(FakeGenerationEngine(name="fake", delay_s=0.001), scheduler=scheduler) as url:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": ["a", "b c"], "max_tokens": 4, "seed": 7}).json()
        assert [c["text"] for c in r["choices"]] == [" w0 w1 w2 w3"] * 2
        assert r["usage"]["completion_tokens"] == 8
        steps = metric(url, "accelab_batch_seconds_count")
        assert steps == (4 if scheduler == "continuous" else 1)  # one step per token, or one generate call


def test_a_prompt_past_the_context_is_a_400_or_keeps_its_last_tokens_when_asked():
    engine = FakeGenerationEngine(name="fake")
    engine.max_context = 10
    with serve(engine) as url:
        body = {"prompt": "a b c d e f g h", "max_tokens": 4}
        r = httpx.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 400
        assert r.json()["error"]["message"].startswith(
            "prompt (8 tokens) + max_tokens (4) is more than fake's context of 10 tokens; lower max_tokens to 2"
        )
        assert metric(url, "accelab_errors_total", kind="too_long") == 1
        r = httpx.post(f"{url}/v1/completions", json={**body, "truncate": True}).json()
        assert r["usage"] == {"prompt_tokens": 6, "completion_tokens": 4, "total_tokens": 10, "truncated_tokens": 2}
        streamed = {
            "messages": [{"role": "user", "content": "a b c d e f g h"}],
            "max_tokens": 4,
            "truncate": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=streamed) as response:
            events = [
                json.loads(line[6:])
                for line in response.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"
            ]
        assert events[-1]["usage"]["truncated_tokens"] == 2
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 10})
        assert r.status_code == 400 and "leaves no room for a prompt" in r.json()["error"]["message"]


def test_a_lone_request_does_not_wait_for_company_that_is_not_coming():
    """max_wait is for requests on their way; one user alone gets no extra wait (a second of
    max_wait would show in every latency)."""
    engine = FakeEmbeddingEngine(name="fake")
    with serve(engine, max_batch_size=8, max_wait_ms=1000) as url:
        with httpx.Client(base_url=url) as client:
            started = time.perf_counter()
            for i in range(5):
                assert client.post("/v1/embeddings", json={"input": f"hello {i}"}).status_code == 200
            assert time.perf_counter() - started < 2.0  # not 5 x 1 s
        assert engine.batches == [1] * 5
