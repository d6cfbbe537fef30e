"""Every generation field of the OpenAI API on llama.cpp (SmolLM2's Q4_1 GGUF, plan llamacpp),
over HTTP, on the continuous scheduler (llama.cpp sequences of one context) and on the per-batch
one (one llama.cpp generate call per batch): one server each, and each test fails if its field
were ignored. Log-probabilities are llama.cpp's own: log_softmax of the logits its context
returns for the same tokens (`LlamaEngine.score`), not transformers'. The prompts stay under 64
tokens: from 64 tokens a decode on, ggml's CPU attention takes another kernel and rounds
otherwise, so the reference would no longer be the arithmetic the server did."""

from __future__ import annotations

import asyncio
import json
import math
from collections import Counter

import httpx
import pytest
import torch
from sampling_extremes import EXTREMES, check_extreme

from accelab.catalog.fetch import is_fetched

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
HI = [{"role": "user", "content": "Hi!"}]  # the Q4 model answers it in ~10 tokens, then stops
PROMPT = "The capital of France is"
PARIS = 7042  # " Paris" in SmolLM2's vocabulary
CITY = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 24}},
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather in a city", "parameters": CITY},
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "description": "The local time in a city", "parameters": CITY},
}
# the static server waits this long for company, so that requests sent together share a generate call
STATIC_WAIT_MS = 100.0


@pytest.fixture(scope="module", params=["continuous", "static"])
def server(request):
    """(base URL, server state) of a llama.cpp server on the scheduler of the param."""
    if not is_fetched(MODEL):
        pytest.skip(f"run `accelab models fetch {MODEL}` first")
    pytest.importorskip("llama_cpp")
    from serving import running_server

    from accelab.catalog.resolve import resolve
    from accelab.plan.plan import load_plan
    from accelab.serve.app import create_app
    from accelab.serve.config import ServeConfig
    from accelab.serve.server import engine_factory

    factory = engine_factory(resolve(MODEL, fetch=False), load_plan("llamacpp"), torch.device("cpu"), name=MODEL)
    wait = STATIC_WAIT_MS if request.param == "static" else 5.0
    config = ServeConfig(model_name=MODEL, scheduler=request.param, max_tokens=128, max_batch_size=4, max_wait_ms=wait)
    app = create_app(config, factory)
    with running_server(app, ready_timeout_s=300) as base:
        state = app.state.accelab
        assert "llama.cpp" in state.engine.runnable.notes[0]
        assert (state.continuous is not None) == (request.param == "continuous")  # no silent fallback
        yield base, state


def post(url: str, path: str, body: dict, status: int = 200) -> dict:
    r = httpx.post(f"{url}{path}", json={"model": MODEL, **body}, timeout=300)
    assert r.status_code == status, r.text
    return r.json()


def chat(url: str, status: int = 200, **body) -> dict:
    return post(url, "/v1/chat/completions", {"messages": FRANCE, "temperature": 0, **body}, status)


def complete(url: str, status: int = 200, **body) -> dict:
    return post(url, "/v1/completions", {"prompt": PROMPT, "temperature": 0, **body}, status)


def stream(url: str, path: str, body: dict) -> list[dict]:
    """The data chunks of a streamed answer."""
    with httpx.stream(
        "POST", f"{url}{path}", timeout=300, json={"model": MODEL, "temperature": 0, "stream": True, **body}
    ) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def text(reply: dict, i: int = 0) -> str:
    choice = reply["choices"][i]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def llama_logprobs(state, ids: list[int]) -> torch.Tensor:
    """llama.cpp's log_softmax of the logits of every position of `ids`: [L, V]. Called while
    the server idles (the engine's scoring context is the server's)."""
    logits = state.engine.runnable.model.engine.score(torch.tensor([ids], dtype=torch.long), None)[0]
    return torch.log_softmax(logits.float(), dim=-1)


# -- log-probabilities ---------------------------------------------------------------------------
def test_completion_echo_and_logprobs_are_llamacpps_own(server):
    url, state = server
    ids = list(state.engine.prepare_text(PROMPT).ids)
    greedy = list(ids)
    for _ in range(4):  # llama.cpp's own greedy continuation
        greedy.append(int(llama_logprobs(state, greedy)[-1].argmax()))
    want = llama_logprobs(state, greedy)  # [L, V]
    reply = complete(url, prompt=ids, max_tokens=4, echo=True, logprobs=3)
    lp = reply["choices"][0]["logprobs"]
    assert reply["choices"][0]["text"] == state.engine.decode(greedy)  # echo: the prompt, then the answer
    assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(greedy)
    for pos in range(1, len(greedy)):  # the prompt's (echo) and the answer's
        expected = float(want[pos - 1, greedy[pos]])
        assert math.isclose(lp["token_logprobs"][pos], expected, abs_tol=1e-3), (pos, lp["token_logprobs"][pos])
        got = sorted(lp["top_logprobs"][pos].values(), reverse=True)
        best = torch.topk(want[pos - 1], 3).values.tolist()
        assert len(got) == 3 and all(math.isclose(g, w, abs_tol=1e-3) for g, w in zip(got, best))
    plain = complete(url, prompt=ids, max_tokens=4)["choices"][0]
    assert plain["logprobs"] is None and plain["text"] == state.engine.decode(greedy[len(ids) :])


def test_chat_logprobs_with_twenty_top_logprobs_are_llamacpps_own(server):
    url, state = server
    reply = chat(url, max_tokens=6, logprobs=True, top_logprobs=20)
    content = reply["choices"][0]["logprobs"]["content"]
    assert len(content) == reply["usage"]["completion_tokens"] and all(len(c["top_logprobs"]) == 20 for c in content)
    prompt = list(state.engine.prepare_chat(FRANCE).ids)
    answer = state.engine.tokenizer(text(reply), add_special_tokens=False)["input_ids"]
    assert [state.engine.decode([t]) for t in answer] == [c["token"] for c in content]
    want = llama_logprobs(state, prompt + answer)
    for i, entry in enumerate(content):
        row = want[len(prompt) - 1 + i]
        assert math.isclose(entry["logprob"], float(row[answer[i]]), abs_tol=1e-3)
        best = torch.topk(row, 20).values.tolist()
        assert all(math.isclose(t["logprob"], w, abs_tol=1e-3) for t, w in zip(entry["top_logprobs"], best))
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy: the best one
    assert chat(url, max_tokens=4)["choices"][0]["logprobs"] is None
    assert chat(url, 422, max_tokens=4, logprobs=True, top_logprobs=21)["error"]["param"] == "top_logprobs"


def test_streamed_chat_and_completion_logprobs_are_the_unstreamed_ones(server):
    url, _ = server
    full = chat(url, max_tokens=6, logprobs=True, top_logprobs=2)["choices"][0]["logprobs"]["content"]
    chunks = stream(
        url, "/v1/chat/completions", {"messages": FRANCE, "max_tokens": 6, "logprobs": True, "top_logprobs": 2}
    )
    entries = [e for c in chunks for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
    assert [e["token"] for e in entries] == [e["token"] for e in full] and len(full) > 0
    assert all(math.isclose(a["logprob"], b["logprob"], abs_tol=1e-3) for a, b in zip(entries, full, strict=True))
    assert all(c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["delta"].get("content"))

    whole = complete(url, max_tokens=5, logprobs=2)["choices"][0]["logprobs"]
    parts = [
        c["choices"][0]["logprobs"]
        for c in stream(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "logprobs": 2})
        if c["choices"][0].get("logprobs")
    ]
    assert [t for p in parts for t in p["tokens"]] == whole["tokens"] and len(whole["tokens"]) == 5
    streamed = [v for p in parts for v in p["token_logprobs"]]
    assert all(math.isclose(a, b, abs_tol=1e-3) for a, b in zip(streamed, whole["token_logprobs"], strict=True))
    assert all(len(top) == 2 for p in parts for top in p["top_logprobs"])


# -- n and the sampling controls ------------------------------------------------------------------
def test_n_choices_greedy_alike_sampled_apart_and_seeded_repeatable(server):
    url, _ = server
    one = chat(url, max_tokens=8)
    three = chat(url, max_tokens=8, n=3)
    assert [c["index"] for c in three["choices"]] == [0, 1, 2] and {text(three, i) for i in range(3)} == {text(one)}
    assert three["usage"]["completion_tokens"] == 3 * one["usage"]["completion_tokens"]
    assert three["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    sampled = chat(url, max_tokens=12, n=4, temperature=1.0, seed=7)
    answers = [text(sampled, i) for i in range(4)]
    assert len(set(answers)) >= 3
    assert [text(chat(url, max_tokens=12, n=4, temperature=1.0, seed=7), i) for i in range(4)] == answers


def test_n_choices_prefill_the_prompt_once_on_the_continuous_scheduler(server, request):
    """The other choices share the first one's llama.cpp cells (a fork): the prefix-cache counter
    grows by the prompt less its last token per extra choice, on a prompt no request sent before.
    The per-batch scheduler runs each choice as a row of one generate call: nothing shared."""
    url, _ = server
    prompt = "Name three rivers that flow through the city of Vienna, and say how long each one is"
    before = metric(url, "accelab_prefix_cache_tokens_total")
    reply = complete(url, prompt=prompt, max_tokens=4, n=3)
    assert len(reply["choices"]) == 3
    continuous = request.node.callspec.params["server"] == "continuous"
    shared = 2 * (reply["usage"]["prompt_tokens"] - 1) if continuous else 0
    assert metric(url, "accelab_prefix_cache_tokens_total") - before == shared


def metric(url: str, name: str) -> float:
    page = httpx.get(f"{url}/metrics", timeout=30).text
    return float(next(line.split()[1] for line in page.splitlines() if line.startswith(f"{name} ")))


def test_top_k_and_min_p_narrow_sampling_to_the_greedy_token(server):
    url, _ = server
    greedy = text(chat(url, max_tokens=10))
    hot = [text(chat(url, max_tokens=10, temperature=2.0, seed=s)) for s in (1, 2)]
    assert greedy not in hot  # at temperature 2 a sampled answer wanders off
    assert [text(chat(url, max_tokens=10, temperature=2.0, seed=s, top_k=1)) for s in (1, 2)] == [greedy] * 2
    assert [text(chat(url, max_tokens=10, temperature=2.0, seed=s, min_p=1.0)) for s in (1, 2)] == [greedy] * 2


def test_penalties_cut_the_repetition(server):
    url, _ = server
    # "Say 'la' twenty times: la la la ..." was too strong an attractor: on an AVX2 EPYC's Q4_1 kernels
    # " la" led by more than presence_penalty's largest value (2.0) at every step, so it came back alike
    loop = [{"role": "user", "content": "Write 'hello' ten times."}]

    def repeats(answer: str) -> int:
        return Counter(answer.split()).most_common(1)[0][1] if answer.split() else 0

    plain = text(chat(url, messages=loop, max_tokens=24))
    assert repeats(plain) >= 8, plain
    for field, value in (("repetition_penalty", 1.8), ("presence_penalty", 2.0), ("frequency_penalty", 2.0)):
        penalised = text(chat(url, messages=loop, max_tokens=24, **{field: value}))
        assert repeats(penalised) < repeats(plain), (field, penalised)


def test_logit_bias_forces_and_forbids_tokens(server):
    url, _ = server
    assert text(complete(url, max_tokens=3)).startswith(" Paris")
    assert text(complete(url, max_tokens=3, logit_bias={str(PARIS): 100})) == " Paris Paris Paris"
    assert not text(complete(url, max_tokens=3, logit_bias={str(PARIS): -100})).startswith(" Paris")


def test_stop_token_ids_min_tokens_and_ignore_eos(server):
    url, _ = server
    stopped = complete(url, max_tokens=8, stop_token_ids=[PARIS])
    assert text(stopped) == "" and stopped["choices"][0]["finish_reason"] == "stop"
    short = chat(url, messages=HI, max_tokens=40)
    assert short["choices"][0]["finish_reason"] == "stop" and short["usage"]["completion_tokens"] < 20
    longer = chat(url, messages=HI, max_tokens=40, min_tokens=25)
    assert longer["usage"]["completion_tokens"] >= 25
    exact = chat(url, messages=HI, max_tokens=40, ignore_eos=True)
    assert exact["usage"]["completion_tokens"] == 40 and exact["choices"][0]["finish_reason"] == "length"


# -- structured outputs and tools ------------------------------------------------------------------
def test_json_schema_answers_validate_and_json_object_is_an_object(server):
    import jsonschema

    url, _ = server
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    questions = ["Describe Paris as JSON.", "Tell me about Tokyo.", "Your favourite city?"]

    async def ask_all() -> list[dict]:
        async with httpx.AsyncClient(timeout=300) as client:
            bodies = [
                {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": q}],
                    "max_tokens": 48,
                    "temperature": 0.7 if i % 2 else 0,
                    "seed": i,
                    "response_format": fmt,
                }
                for i, q in enumerate(questions)
            ]
            replies = await asyncio.gather(*(client.post(f"{url}/v1/chat/completions", json=b) for b in bodies))
            return [r.json() for r in replies]

    for reply in asyncio.run(ask_all()):
        assert reply["choices"][0]["finish_reason"] == "stop", text(reply)
        jsonschema.validate(json.loads(text(reply)), CITY)
    assert not text(chat(url, max_tokens=12)).lstrip().startswith("{")  # unconstrained, it is prose
    assert isinstance(json.loads(text(chat(url, max_tokens=48, response_format={"type": "json_object"}))), dict)


def test_tool_choice_required_named_auto_and_none(server):
    url, _ = server
    ask = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    required = chat(url, messages=ask, max_tokens=40, tools=[WEATHER, TIME], tool_choice="required")
    choice = required["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] in ("get_weather", "get_time") and "city" in json.loads(
        call["function"]["arguments"]
    )
    named = chat(
        url,
        messages=ask,
        max_tokens=40,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    assert named["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_time"
    none = chat(url, messages=ask, max_tokens=16, tools=[WEATHER], tool_choice="none")
    assert none["choices"][0]["finish_reason"] != "tool_calls" and "tool_calls" not in none["choices"][0]["message"]
    auto = chat(url, messages=ask, max_tokens=40, tools=[WEATHER])  # the model's choice: either is valid
    message = auto["choices"][0]["message"]
    # but the tools reach the model: they are written into the prompt
    assert auto["usage"]["prompt_tokens"] > chat(url, messages=ask, max_tokens=1)["usage"]["prompt_tokens"] + 20
    assert bool(message.get("tool_calls")) == (auto["choices"][0]["finish_reason"] == "tool_calls")
    if not message.get("tool_calls"):
        assert message["content"] and not message["content"].startswith("<")


def test_streamed_tool_call_is_one_delta(server):
    url, _ = server
    body = {
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "max_tokens": 40,
        "tools": [WEATHER],
        "tool_choice": "required",
    }
    chunks = stream(url, "/v1/chat/completions", body)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert not any(d.get("content") for d in deltas)  # the call's text is not streamed as content
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"])["city"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


# -- one batch, many rules; and refusals ----------------------------------------------------------
def test_requests_with_different_rules_share_a_batch_and_each_keeps_its_own(server):
    """Sent together, the requests share llama.cpp decodes (the continuous steps, or one
    generate call of the per-batch scheduler: /metrics counts more rows than model calls), and
    each answer follows its own rules. Not compared with the answers alone: llama.cpp's
    attention rounds otherwise from 64 tokens a decode on, so a near-tie may flip in company."""
    url, _ = server
    schema = {"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}}
    bodies = [
        {"max_tokens": 8},
        {"max_tokens": 8, "logit_bias": {str(PARIS): 100}},
        {"max_tokens": 12, "ignore_eos": True},
        {"max_tokens": 30, "response_format": schema},
    ]

    async def together() -> list[dict]:
        async with httpx.AsyncClient(timeout=300) as client:
            rs = await asyncio.gather(
                *(
                    client.post(
                        f"{url}/v1/chat/completions",
                        json={"model": MODEL, "messages": FRANCE, "temperature": 0, **b},
                    )
                    for b in bodies
                )
            )
            return [r.json() for r in rs]

    calls, rows = metric(url, "accelab_batch_size_count"), metric(url, "accelab_batch_size_sum")
    shared = asyncio.run(together())
    calls, rows = metric(url, "accelab_batch_size_count") - calls, metric(url, "accelab_batch_size_sum") - rows
    assert rows > calls  # some model call ran more than one of them
    assert "Paris Paris" not in text(shared[0]) and not text(shared[0]).lstrip().startswith("{")
    assert "Paris Paris" in text(shared[1])
    assert shared[2]["usage"]["completion_tokens"] == 12 and shared[2]["choices"][0]["finish_reason"] == "length"
    assert set(json.loads(text(shared[3]))) == {"city"}


def test_fields_the_server_does_not_honour_are_refused_by_name(server):
    url, _ = server
    for body, field in (({"best_of": 3}, "best_of"), ({"frobnicate": 1}, "frobnicate")):
        error = chat(url, 400, max_tokens=2, **body)["error"]
        assert error["param"] == field and field in error["message"]
    assert chat(url, 400, max_tokens=4, min_tokens=5)["error"]["param"] == "min_tokens"
    assert chat(url, 400, max_tokens=4, logit_bias={"99999": 5})["error"]["param"] == "logit_bias"


@pytest.mark.parametrize("extreme", EXTREMES, ids=",".join)
def test_extreme_sampling_values_answer_200_and_tiny_ones_are_greedy(server, extreme):
    check_extreme(chat, server[0], extreme)


def test_a_stream_cut_short_frees_its_slots_for_the_next_request_at_once(server):
    """Found by fuzzing: a client that reads a few events of a stream holding every slot and
    hangs up, then sends the next request at once. The cancelled sequences kept their llama.cpp
    slots until after the next admission, the scheduler found none free, its worker thread died,
    and every request after that waited out its deadline (504)."""
    url, state = server
    body = {"model": MODEL, "prompt": [PROMPT] * 6, "max_tokens": 64, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 8:  # more events than slots: every slot is decoding
                break
    for _ in range(3):
        answer = chat(url, max_tokens=4)
        assert answer["choices"][0]["message"]["content"]
    assert state.continuous is None or state.continuous.alive
