"""Every generation field of the OpenAI API on the real SmolLM2, over HTTP, on the continuous
scheduler and on the per-batch one (one server each): each test fails if its field were
ignored. Logprobs are checked against transformers' own log_softmax of the model's logits;
answers under a JSON schema are validated with jsonschema; requests with different rules
share the continuous batch and each keeps its own."""

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
PROMPT = "The capital of France is"
PARIS = 7042  # " Paris" in SmolLM2's vocabulary
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module", params=["continuous", "static"])
def url(request):
    if not is_fetched(MODEL):
        pytest.skip(f"run `accelab models fetch {MODEL}` first")
    from serving import running_server

    from accelab.catalog.resolve import resolve
    from accelab.plan.plan import load_plan
    from accelab.serve.app import create_app
    from accelab.serve.config import ServeConfig
    from accelab.serve.server import engine_factory

    factory = engine_factory(resolve(MODEL, fetch=False), load_plan("baseline"), torch.device("cpu"), name=MODEL)
    config = ServeConfig(model_name=MODEL, scheduler=request.param, max_tokens=256, max_batch_size=8)
    with running_server(create_app(config, factory), ready_timeout_s=300) as base:
        yield base


@pytest.fixture(scope="module")
def reference():
    """transformers' own model and tokenizer (fp32, its default attention): the logprobs' judge."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from accelab.catalog.store import model_dir

    path = model_dir(MODEL)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def post(url: str, path: str, body: dict, status: int = 200) -> dict:
    r = httpx.post(f"{url}{path}", json={"model": MODEL, **body}, timeout=300)
    assert r.status_code == status, r.text
    return r.json()


def chat(url: str, status: int = 200, **body) -> dict:
    return post(url, "/v1/chat/completions", {"messages": FRANCE, "temperature": 0, **body}, status)


def complete(url: str, status: int = 200, **body) -> dict:
    return post(url, "/v1/completions", {"prompt": PROMPT, "temperature": 0, **body}, status)


def text(reply: dict, i: int = 0) -> str:
    choice = reply["choices"][i]
    return choice["message"]["content"] if "message" in choice else choice["text"]


# -- log-probabilities ---------------------------------------------------------------------------
def test_completion_echo_and_logprobs_agree_with_transformers_log_softmax(url, reference):
    model, tokenizer = reference
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        greedy = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)[0].tolist()
        want = torch.log_softmax(model(torch.tensor([greedy])).logits[0].float(), dim=-1)  # [L, V]
    reply = complete(url, prompt=ids, max_tokens=4, echo=True, logprobs=3)
    lp = reply["choices"][0]["logprobs"]
    assert reply["choices"][0]["text"] == tokenizer.decode(greedy)  # echo: the prompt, then the answer
    assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(greedy)
    for pos in range(1, len(greedy)):
        expected = float(want[pos - 1, greedy[pos]])
        assert math.isclose(lp["token_logprobs"][pos], expected, abs_tol=2e-4), (pos, lp["token_logprobs"][pos])
        top = torch.topk(want[pos - 1], 3)
        got = sorted(lp["top_logprobs"][pos].values(), reverse=True)
        assert len(got) == 3 and all(math.isclose(g, float(w), abs_tol=2e-4) for g, w in zip(got, top.values))
    plain = complete(url, prompt=ids, max_tokens=4)["choices"][0]
    assert plain["logprobs"] is None and plain["text"] == tokenizer.decode(greedy[len(ids) :])


def test_chat_logprobs_and_top_logprobs_are_the_models(url, reference):
    model, tokenizer = reference
    reply = chat(url, max_tokens=6, logprobs=True, top_logprobs=5)
    content = reply["choices"][0]["logprobs"]["content"]
    assert len(content) == reply["usage"]["completion_tokens"] and all(len(c["top_logprobs"]) == 5 for c in content)
    templated = tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(templated, add_special_tokens=False)["input_ids"]
    answer = tokenizer(text(reply), add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        want = torch.log_softmax(model(torch.tensor([prompt + answer])).logits[0].float(), dim=-1)
    for i, entry in enumerate(content):
        expected = float(want[len(prompt) - 1 + i, answer[i]])
        assert math.isclose(entry["logprob"], expected, abs_tol=2e-4)
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy: the best one
        assert entry["bytes"] == list(entry["token"].encode())
    assert chat(url, max_tokens=4)["choices"][0]["logprobs"] is None


def test_streamed_logprobs_arrive_with_their_text(url):
    full = chat(url, max_tokens=6, logprobs=True, top_logprobs=2)
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        timeout=300,
        json={
            "messages": FRANCE,
            "temperature": 0,
            "max_tokens": 6,
            "logprobs": True,
            "top_logprobs": 2,
            "stream": True,
        },
    ) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    entries = [e for c in chunks for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
    assert [e["token"] for e in entries] == [e["token"] for e in full["choices"][0]["logprobs"]["content"]]
    with_text = [c for c in chunks if c["choices"][0]["delta"].get("content")]
    assert all(c["choices"][0]["logprobs"] for c in with_text)


def test_streamed_completion_logprobs_are_the_unstreamed_ones(url):
    full = complete(url, max_tokens=5, logprobs=2)["choices"][0]["logprobs"]
    with httpx.stream(
        "POST",
        f"{url}/v1/completions",
        timeout=300,
        json={"model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": 5, "logprobs": 2, "stream": True},
    ) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0].get("logprobs")]
    assert [t for p in parts for t in p["tokens"]] == full["tokens"] and len(full["tokens"]) == 5
    streamed = [v for p in parts for v in p["token_logprobs"]]
    assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(streamed, full["token_logprobs"], strict=True))
    assert all(len(top) == 2 for p in parts for top in p["top_logprobs"])


# -- n and the sampling controls ------------------------------------------------------------------
def test_n_choices_greedy_alike_sampled_apart_and_seeded_repeatable(url):
    one = text(chat(url, max_tokens=8))
    three = chat(url, max_tokens=8, n=3)
    assert [c["index"] for c in three["choices"]] == [0, 1, 2] and {text(three, i) for i in range(3)} == {one}
    single = chat(url, max_tokens=8)["usage"]
    # OpenAI's usage: the prompt once, every choice's completion
    assert three["usage"]["completion_tokens"] == 3 * single["completion_tokens"]
    assert three["usage"]["prompt_tokens"] == single["prompt_tokens"]
    sampled = chat(url, max_tokens=12, n=4, temperature=1.0, seed=7)
    answers = [text(sampled, i) for i in range(4)]
    assert len(set(answers)) >= 3
    assert [text(chat(url, max_tokens=12, n=4, temperature=1.0, seed=7), i) for i in range(4)] == answers
    two_prompts = post(
        url,
        "/v1/completions",
        {"prompt": [PROMPT, "Berlin is the capital of"], "n": 2, "max_tokens": 3, "temperature": 0},
    )
    assert [c["index"] for c in two_prompts["choices"]] == [0, 1, 2, 3]
    assert text(two_prompts, 0) == text(two_prompts, 1) != text(two_prompts, 2) == text(two_prompts, 3)


def test_n_choices_prefill_the_prompt_once_on_the_continuous_scheduler(url, request):
    """The other choices take the first one's prompt KV (a fork): the prefix-cache counter grows
    by the prompt less its last token per extra choice, on a prompt no request sent before. The
    per-batch scheduler runs each choice as a row of one generate call (README): nothing shared."""
    prompt = "Name three rivers that flow through the city of Vienna, and say how long each one is"
    before = prefix_cache_tokens(url)
    reply = complete(url, prompt=prompt, max_tokens=4, n=3)
    assert len(reply["choices"]) == 3
    shared = 2 * (reply["usage"]["prompt_tokens"] - 1) if request.node.callspec.params["url"] == "continuous" else 0
    assert prefix_cache_tokens(url) - before == shared


def prefix_cache_tokens(url: str) -> float:
    page = httpx.get(f"{url}/metrics", timeout=30).text
    line = next(line for line in page.splitlines() if line.startswith("accelab_prefix_cache_tokens_total "))
    return float(line.split()[1])


def test_top_k_and_min_p_narrow_sampling_to_the_greedy_token(url):
    greedy = text(chat(url, max_tokens=10))
    hot = [text(chat(url, max_tokens=10, temperature=2.0, seed=s)) for s in (1, 2)]
    assert greedy not in hot  # at temperature 2 a sampled answer wanders off
    assert [text(chat(url, max_tokens=10, temperature=2.0, seed=s, top_k=1)) for s in (1, 2)] == [greedy] * 2
    assert [text(chat(url, max_tokens=10, temperature=2.0, seed=s, min_p=1.0)) for s in (1, 2)] == [greedy] * 2


def test_penalties_cut_the_repetition(url):
    loop = [{"role": "user", "content": "Say 'la' twenty times: la la la la la la la la"}]

    def repeats(answer: str) -> int:
        return Counter(answer.split()).most_common(1)[0][1] if answer.split() else 0

    plain = text(chat(url, messages=loop, max_tokens=24))
    assert repeats(plain) >= 8
    for field, value in (("repetition_penalty", 1.8), ("presence_penalty", 2.0), ("frequency_penalty", 2.0)):
        penalised = text(chat(url, messages=loop, max_tokens=24, **{field: value}))
        assert repeats(penalised) < repeats(plain), (field, penalised)


def test_logit_bias_forces_and_forbids_tokens(url):
    forced = complete(url, max_tokens=3, logit_bias={str(PARIS): 100})
    assert text(forced) == " Paris Paris Paris"
    answer = text(complete(url, max_tokens=3))
    assert answer.startswith(" Paris")
    assert not text(complete(url, max_tokens=3, logit_bias={str(PARIS): -100})).startswith(" Paris")


def test_stop_token_ids_min_tokens_and_ignore_eos(url):
    stopped = complete(url, max_tokens=8, stop_token_ids=[PARIS])
    assert text(stopped) == "" and stopped["choices"][0]["finish_reason"] == "stop"
    short = chat(url, max_tokens=40)
    assert short["choices"][0]["finish_reason"] == "stop" and short["usage"]["completion_tokens"] < 20
    longer = chat(url, max_tokens=40, min_tokens=25)
    assert longer["usage"]["completion_tokens"] >= 25
    exact = chat(url, max_tokens=40, ignore_eos=True)
    assert exact["usage"]["completion_tokens"] == 40 and exact["choices"][0]["finish_reason"] == "length"


# -- structured outputs and tools ------------------------------------------------------------------
CITY = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "country", "population"],
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
    },
}
QUESTIONS = [
    "Describe Paris as JSON.",
    "Tell me about Tokyo.",
    "Give me facts on Lagos.",
    "What about Lima?",
    "A city in Canada, please.",
    "Your favourite city?",
]


def test_every_answer_under_a_json_schema_validates_and_json_object_is_an_object(url):
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}

    async def ask_all() -> list[dict]:
        async with httpx.AsyncClient(timeout=300) as client:
            bodies = [
                {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": q}],
                    "max_tokens": 96,
                    "temperature": 0.7 if i % 2 else 0,
                    "seed": i,
                    "response_format": fmt,
                }
                for i, q in enumerate(QUESTIONS)
            ]
            replies = await asyncio.gather(*(client.post(f"{url}/v1/chat/completions", json=b) for b in bodies))
            return [r.json() for r in replies]

    replies = asyncio.run(ask_all())
    for reply in replies:
        assert reply["choices"][0]["finish_reason"] == "stop", text(reply)
        jsonschema.validate(json.loads(text(reply)), CITY)
    assert not text(chat(url, max_tokens=12)).lstrip().startswith("{")  # unconstrained, it is prose
    value = json.loads(text(chat(url, max_tokens=48, response_format={"type": "json_object"})))
    assert isinstance(value, dict)
    bad = chat(
        url,
        400,
        max_tokens=8,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}},
        },
    )
    assert bad["error"]["param"] == "response_format"


def test_tool_choice_required_named_auto_and_none(url):
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
    # but the tools reach the model: the chat template writes them into the prompt
    assert auto["usage"]["prompt_tokens"] > chat(url, messages=ask, max_tokens=1)["usage"]["prompt_tokens"] + 20
    assert bool(message.get("tool_calls")) == (auto["choices"][0]["finish_reason"] == "tool_calls")
    if not message.get("tool_calls"):
        assert message["content"] and not message["content"].startswith("<")


def test_streamed_tool_call_is_one_delta(url):
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        timeout=300,
        json={
            "messages": [{"role": "user", "content": "Weather in Oslo?"}],
            "temperature": 0,
            "max_tokens": 40,
            "tools": [WEATHER],
            "tool_choice": "required",
            "stream": True,
        },
    ) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert not any(d.get("content") for d in deltas)  # the call's text is not streamed as content
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"])["city"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


# -- one batch, many rules; and refusals ----------------------------------------------------------
def test_requests_with_different_rules_share_a_batch_and_each_keeps_its_own(url):
    bodies = [
        {"messages": FRANCE, "max_tokens": 8, "temperature": 0},
        {"messages": FRANCE, "max_tokens": 8, "temperature": 0, "logit_bias": {str(PARIS): 100}},
        {"messages": FRANCE, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
        {"messages": FRANCE, "max_tokens": 30, "temperature": 0, "response_format": {"type": "json_object"}},
    ]
    alone = [post(url, "/v1/chat/completions", b) for b in bodies]

    async def together() -> list[dict]:
        async with httpx.AsyncClient(timeout=300) as client:
            rs = await asyncio.gather(*(client.post(f"{url}/v1/chat/completions", json=b) for b in bodies))
            return [r.json() for r in rs]

    shared = asyncio.run(together())
    assert [text(r) for r in shared] == [text(r) for r in alone]
    assert "Paris Paris" in text(shared[1]) and shared[2]["usage"]["completion_tokens"] == 12
    assert isinstance(json.loads(text(shared[3])), dict) and not text(shared[0]).startswith("{")


def test_fields_the_server_does_not_honour_are_refused_by_name(url):
    for body, field in (
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"best_of": 3}, "best_of"),
        ({"guided_json": {}}, "guided_json"),
    ):
        error = chat(url, 400, max_tokens=2, **body)["error"]
        assert error["param"] == field and field in error["message"]
    assert complete(url, 400, max_tokens=2, suffix="x")["error"]["param"] == "suffix"
    assert chat(url, 400, max_tokens=4, min_tokens=5)["error"]["param"] == "min_tokens"
    assert chat(url, 400, max_tokens=4, logit_bias={"99999": 5})["error"]["param"] == "logit_bias"
    assert chat(url, 422, max_tokens=4, top_logprobs=21, logprobs=True)["error"]["param"] == "top_logprobs"
    assert text(chat(url, max_tokens=4, user="someone", store=False)) == text(chat(url, max_tokens=4))


@pytest.mark.parametrize("extreme", EXTREMES, ids=",".join)
def test_extreme_sampling_values_answer_200_and_tiny_ones_are_greedy(url, extreme):
    check_extreme(chat, url, extreme)
