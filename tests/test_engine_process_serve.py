"""`accelab serve smollm2-135m --plan vllm` and `--plan openvino-int8`: a real engine process (vLLM
from .venv-vllm, OpenVINO GenAI's ContinuousBatchingPipeline from .venv-openvino) behind accelab's
server, one server per plan (with an engine of its own: a server never attaches to another
process's engine, even one of the same options in the same /tmp), through the official openai
client and raw HTTP: routes, streaming, errors, concurrent streams, /metrics, a client that hangs
up, a field the engine cannot honour, and SIGTERM drain (last for each plan: it stops the server
and its engine)."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import psutil
import pytest
from sampling_extremes import EXTREMES, check_extreme

from accelab.catalog.fetch import is_fetched

openai = pytest.importorskip("openai")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("vllm"),  # one worker: one vLLM engine (GiBs of KV cache) up at a time
    # not alone: nothing here is a speed; its waits (the engines' starts) leave the second core to
    # the other worker, and its checks wait for what they check (every stream started, a drain)
    pytest.mark.skipif(not is_fetched("smollm2-135m"), reason="run `accelab models fetch smollm2-135m` first"),
]

MODEL = "smollm2-135m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


# plan -> the option that caps its engine's running sequences
PLANS = {"vllm": "vllm_max_num_seqs=16", "openvino-int8": "ov_max_num_seqs=16"}
ENGINE_MARKS = {"vllm": ("vllm_engine.py", ".venv-vllm"), "openvino-int8": ("openvino_engine.py", ".venv-openvino")}


@pytest.fixture(scope="module", params=list(PLANS))
def server(request):
    from serving import ServerProcess

    plan = request.param
    proc = ServerProcess(
        "-m",
        "accelab.serve",
        MODEL,
        "--plan",
        plan,
        "--set",
        PLANS[plan],
        "--port",
        "0",
        "--max-tokens",
        "256",  # the SIGTERM test's streams are this long: still streaming when it checks them
        "--grace-period",
        "60",
        timeout_s=120,
    )
    try:
        proc.wait_ready(timeout_s=900)  # vLLM's engine starts in 30 s (eager) to minutes on a busy machine
        proc.plan = plan
        proc.engines = [c for c in psutil.Process(proc.proc.pid).children() if _is_engine(c, plan)]
        yield proc
    finally:
        proc.stop()


def _is_engine(process: psutil.Process, plan: str) -> bool:
    """accelab's engine process for `plan`: its script on the command line, or its venv's Python
    (vLLM may retitle its processes)."""
    script, venv = ENGINE_MARKS[plan]
    try:
        return any(script in part for part in process.cmdline()) or venv in process.exe()
    except psutil.Error:
        return False


def client(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name)]
    assert values, f"{name} not in /metrics"
    return sum(values)


def test_chat_and_completions_streaming_and_not(server):
    c = client(server.url)
    assert [m.id for m in c.models.list().data] == [MODEL]
    reply = c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0)
    answer = reply.choices[0].message.content
    assert "Paris" in answer
    assert reply.usage.prompt_tokens > 5 and 1 <= reply.usage.completion_tokens <= 8
    stream = c.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == answer  # greedy: the same
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    short = c.completions.create(model=MODEL, prompt="The capital of Germany is", max_tokens=3, temperature=0)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"
    stopped = c.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=20, temperature=0, stop=["."]
    )
    assert stopped.choices[0].finish_reason == "stop" and "." not in stopped.choices[0].text
    assert "Paris" in stopped.choices[0].text
    sampled = [
        c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=7)
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]  # a seed repeats itself on the engine's sampler too


def test_bad_requests_fail_alone_with_the_reason(server):
    url = f"{server.url}/v1"
    too_many = httpx.post(f"{url}/chat/completions", json={"model": MODEL, "messages": QUESTION, "max_tokens": 257})
    assert too_many.status_code == 413 and "--max-tokens" in too_many.text
    wrong = httpx.post(f"{url}/chat/completions", json={"model": "other", "messages": QUESTION})
    assert wrong.status_code == 404 and MODEL in wrong.text
    empty = httpx.post(f"{url}/completions", json={"model": MODEL, "prompt": "", "max_tokens": 2})
    assert empty.status_code == 422 and "empty" in empty.text
    outside = httpx.post(f"{url}/completions", json={"model": MODEL, "prompt": [1, 49152], "max_tokens": 2})
    assert outside.status_code == 422 and "49152" in outside.text
    long = httpx.post(f"{url}/completions", json={"model": MODEL, "prompt": [1] * 8190, "max_tokens": 8})
    assert long.status_code == 400 and "8192" in long.text
    fine = httpx.post(f"{url}/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
    assert fine.status_code == 200 and fine.json()["usage"]["completion_tokens"] == 2


def test_eight_concurrent_streams_and_the_metrics_follow_the_engine(server):
    generated_before = metric(server.url, "accelab_generated_tokens_total")
    results: list = []

    def one(i: int) -> None:
        stream = client(server.url).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Count to {i + 3}."}],
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = list(stream)
        results.append(chunks[-1].usage.completion_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 8 and all(1 <= n <= 24 for n in results)
    assert metric(server.url, "accelab_generated_tokens_total") - generated_before == sum(results)
    assert metric(server.url, 'accelab_kv_cache_blocks{state="free"}') > 0
    assert metric(server.url, "accelab_running_sequences") == 0  # the engine's count, after the last step
    assert metric(server.url, "accelab_time_to_first_token_seconds_count") >= 8
    assert metric(server.url, "accelab_inter_token_latency_seconds_count") > 0


def test_a_client_that_hangs_up_mid_stream_frees_its_sequence(server):
    body = {
        "model": MODEL,
        "prompt": "Write a long story about a dragon.",
        "max_tokens": 64,
        "stream": True,
        "temperature": 0,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        got = [next(lines) for _ in range(4)]
        assert any(line.startswith("data:") for line in got)
    deadline = time.monotonic() + 10
    while metric(server.url, "accelab_requests_in_flight") > 0:
        assert time.monotonic() < deadline, "the abandoned stream is still in flight"
        time.sleep(0.05)
    after = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert after.status_code == 200


def test_readyz_names_the_engine_process_that_runs_the_model(server):
    """Whoever counts the server's memory (tune --scenario serve) must count the engine process too."""
    body = httpx.get(f"{server.url}/readyz").json()
    assert body["status"] == "ready" and body["worker_pids"]
    assert all(_is_engine(psutil.Process(pid), server.plan) for pid in body["worker_pids"])


def test_a_field_the_engine_cannot_honour_is_a_400_that_names_it(server):
    """Structured output and logprobs run on torch's sampler only; OpenVINO GenAI's sampler has no
    logit_bias (vLLM's has). Nothing is silently ignored, and the server serves on."""
    url = f"{server.url}/v1/chat/completions"
    logprobs = httpx.post(url, json={"model": MODEL, "messages": QUESTION, "max_tokens": 2, "logprobs": True})
    assert logprobs.status_code == 400 and "logprobs" in logprobs.text
    bias = httpx.post(url, json={"model": MODEL, "messages": QUESTION, "max_tokens": 2, "logit_bias": {"11": -100}})
    if server.plan == "openvino-int8":
        assert bias.status_code == 400 and "logit_bias" in bias.text
    else:
        assert bias.status_code == 200
    assert chat(server.url, max_tokens=2)["usage"]["completion_tokens"] == 2


def chat(url: str, status: int = 200, **body) -> dict:
    r = httpx.post(
        f"{url}/v1/chat/completions", json={"model": MODEL, "messages": QUESTION, "temperature": 0, **body}, timeout=300
    )
    assert r.status_code == status, r.text
    return r.json()


def reply_text(reply: dict) -> str:
    return reply["choices"][0]["message"]["content"]


@pytest.mark.parametrize("extreme", EXTREMES, ids=",".join)
def test_extreme_sampling_values_answer_200_and_tiny_ones_are_greedy(server, extreme):
    """The values that once answered 500 on the torch engine, on the engine process: a temperature
    below 1e-5 reaches it as 0 (greedy), a tiny top_p keeps its most likely token."""
    check_extreme(chat, server.url, extreme, text=reply_text)


def test_sigterm_finishes_in_flight_streams_refuses_new_ones_and_stops_the_engine(server):
    assert len(server.engines) == 1  # this server's own engine process
    results: list = []
    streaming = [threading.Event() for _ in range(3)]

    def one(started: threading.Event) -> None:
        with httpx.stream(
            "POST",
            f"{server.url}/v1/completions",
            timeout=120,
            json={
                "model": MODEL,
                "prompt": "Tell me about Paris.",
                "max_tokens": 256,  # ~3-10 s of decoding: a stream that started late finds the others still running
                "stream": True,
                "temperature": 0,
                "ignore_eos": True,
            },
        ) as response:
            text = []
            for line in response.iter_lines():
                if line.startswith("data:"):
                    text.append(line)
                    started.set()
            results.append((response.status_code, text[-1] if text else "no data: lines"))

    threads = [threading.Thread(target=one, args=(e,)) for e in streaming]
    for t in threads:
        t.start()
    # SIGTERM only once every stream has its first token: a request still on its way (a slow
    # machine) would be refused, rightly, and that is not what this test is about
    assert all(e.wait(60) for e in streaming), results
    assert metric(server.url, "accelab_requests_in_flight") == 3
    server.proc.send_signal(signal.SIGTERM)
    server.wait_draining()
    late = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "late", "max_tokens": 2})
    assert late.status_code == 503 and "shutting down" in late.text
    for t in threads:
        t.join(60)
    assert results == [(200, "data: [DONE]")] * 3
    assert server.proc.wait(30) == 0, "".join(server.log)
    psutil.wait_procs(server.engines, timeout=30)
    assert not any(p.is_running() for p in server.engines)  # the engine left with its server
