"""The same OpenAI fields on llama.cpp (SmolLM2's Q4_1 GGUF): over HTTP through the continuous
llama.cpp steps, and through the per-batch llama.cpp generate of the same loaded engine (called
directly while the server idles). Logprobs are llama.cpp's own: log_softmax of the logits its
context returns for the prompt."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch

from accelab.catalog.fetch import is_fetched

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
PROMPT = "The capital of France is"
CITY = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 24}},
}


@pytest.fixture(scope="module")
def server():
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
    app = create_app(ServeConfig(model_name=MODEL, max_tokens=128, max_batch_size=4), factory)
    with running_server(app, ready_timeout_s=300) as url:
        yield url, app.state.accelab


def post(url: str, path: str, **body) -> dict:
    r = httpx.post(f"{url}{path}", json={"model": MODEL, "temperature": 0, **body}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_continuous_llamacpp_logprobs_are_llamacpps_own(server):
    url, state = server
    assert state.continuous is not None and "llama.cpp" in state.continuous.engine.name
    ids = state.engine.prepare_text(PROMPT).ids
    reply = post(url, "/v1/completions", prompt=list(ids), max_tokens=2, echo=True, logprobs=2)
    lp = reply["choices"][0]["logprobs"]
    logits = state.continuous.engine.score(ids)  # [L, V], llama.cpp's logits of every prompt position
    want = torch.log_softmax(logits.float(), dim=-1)
    for pos in range(1, len(ids)):
        assert math.isclose(lp["token_logprobs"][pos], float(want[pos - 1, ids[pos]]), abs_tol=1e-4)
    assert len(lp["token_logprobs"]) == len(ids) + 2 and all(len(t) == 2 for t in lp["top_logprobs"][1:])
    chat = post(
        url,
        "/v1/chat/completions",
        messages=[{"role": "user", "content": "Hi!"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat["choices"][0]["logprobs"]["content"]
    assert (
        len(content) == chat["usage"]["completion_tokens"]
        and content[0]["top_logprobs"][0]["token"] == content[0]["token"]
    )


def test_continuous_llamacpp_n_rules_schema_and_tools(server):
    url, _ = server
    q = [{"role": "user", "content": "What is the capital of France?"}]
    one = post(url, "/v1/chat/completions", messages=q, max_tokens=8)["choices"][0]["message"]["content"]
    three = post(url, "/v1/chat/completions", messages=q, max_tokens=8, n=3)
    assert [c["message"]["content"] for c in three["choices"]] == [one] * 3
    forced = post(url, "/v1/completions", prompt=PROMPT, max_tokens=3, logit_bias={"7042": 100})
    assert forced["choices"][0]["text"] == " Paris Paris Paris"
    exact = post(url, "/v1/chat/completions", messages=q, max_tokens=30, ignore_eos=True)
    assert exact["usage"]["completion_tokens"] == 30
    schema = post(
        url,
        "/v1/chat/completions",
        messages=q,
        max_tokens=30,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}},
    )
    assert set(json.loads(schema["choices"][0]["message"]["content"])) == {"city"}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
    called = post(url, "/v1/chat/completions", messages=q, max_tokens=30, tools=[tool], tool_choice="required")
    assert called["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_per_batch_llamacpp_generate_honours_the_same_rules(server):
    """The per-batch llama.cpp generate (the static scheduler's path) on the same engine."""
    from accelab.serve import structured
    from accelab.serve.engines.base import GenUnit, SamplingParams

    url, state = server
    engine = state.engine
    prompt = engine.prepare_chat([{"role": "user", "content": "What is the capital of France?"}])
    plain = SamplingParams(max_tokens=6, temperature=0, logprobs=1)
    grammar = structured.json_grammar(CITY)
    shaped = SamplingParams(max_tokens=30, temperature=0, grammar=grammar)
    solo = engine.generate([GenUnit(prompt=prompt, params=plain)])[0]
    units = [
        GenUnit(
            prompt=prompt,
            params=shaped,
            sampler=engine.sampler(shaped, prompt, grammar=structured.Matcher(engine.grammar_tokenizer(), grammar)),
        ),
        GenUnit(prompt=prompt, params=SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)),
    ]
    out = engine.generate(units)  # two rows with different rules in one batch
    alone = post(
        url,
        "/v1/chat/completions",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=6,
        logprobs=True,
    )["choices"][0]
    assert solo.text == alone["message"]["content"] and len(solo.logprobs) == solo.completion_tokens
    assert math.isclose(solo.logprobs[0].logprob, alone["logprobs"]["content"][0]["logprob"], abs_tol=1e-3)
    assert set(json.loads(out[0].text)) == {"city"} and out[1].completion_tokens == 12
