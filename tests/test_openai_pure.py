"""The OpenAI layer without a model: fields refused by name, tool calls read back from text,
streamed text held back while it could become a call, tools written into a template without a
tool format, and the response shapes of log-probabilities."""

from __future__ import annotations

import json

import pytest

from accelab.serve import openai_format as fmt, tools
from accelab.serve.engines.base import Completion, TokenLogprob
from accelab.serve.schemas import ChatRequest, CompletionRequest, unsupported_fields

Q = [{"role": "user", "content": "hi"}]


def test_unknown_and_unhonoured_fields_are_named_with_what_to_do():
    body = ChatRequest(messages=Q, functions=[{"name": "f"}], frobnicate=1, user="u", store=False, suffix=None)
    refused = dict(unsupported_fields(body))
    assert set(refused) == {"functions", "frobnicate"}  # user is honoured, store false and nulls ask nothing
    assert "tools" in refused["functions"] and "remove it" in refused["frobnicate"]
    assert dict(unsupported_fields(CompletionRequest(prompt="x", suffix="end")))["suffix"].startswith("fill-in")
    assert unsupported_fields(CompletionRequest(prompt="x", best_of=1)) == []
    assert "beam" in dict(unsupported_fields(CompletionRequest(prompt="x", best_of=3)))["best_of"]


def test_request_checks_name_the_field():
    with pytest.raises(ValueError, match="top_logprobs=2 needs logprobs"):
        ChatRequest(messages=Q, top_logprobs=2)
    with pytest.raises(ValueError, match="not among the tools"):
        ChatRequest(
            messages=Q,
            tools=[{"type": "function", "function": {"name": "a"}}],
            tool_choice={"type": "function", "function": {"name": "b"}},
        )
    with pytest.raises(ValueError, match="logit_bias keys are token ids"):
        ChatRequest(messages=Q, logit_bias={"abc": 1})
    # "²" is a digit to isdigit(), not to int() (found by fuzzing)
    with pytest.raises(ValueError, match="logit_bias keys are token ids"):
        ChatRequest(messages=Q, logit_bias={"\u00b2": 1})
    with pytest.raises(ValueError, match="json_schema needs|needs json_schema"):
        ChatRequest(messages=Q, response_format={"type": "json_schema"})


def test_tool_calls_are_read_back_and_text_without_one_stays_text():
    content, calls = tools.parse_calls('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    content, calls = tools.parse_calls('Sure. <tool_call>{"name": "a", "arguments": {}}</tool_call>')
    assert content == "Sure." and calls[0].name == "a" and calls[0].id.startswith("call_")
    assert tools.parse_calls("Paris is sunny.") == ("Paris is sunny.", [])
    assert tools.parse_calls("<tool_call>{broken") == ("<tool_call>{broken", [])


def test_the_stream_filter_holds_back_a_possible_call():
    f = tools.CallFilter()
    assert [f.push(p) for p in ["<tool", "_call>", '{"name"', "}"]] == ["", "", "", ""] and f.calling
    g = tools.CallFilter()
    assert [g.push(p) for p in ["<to", "day is", " fine"]] == ["", "<today is", " fine"]
    h = tools.CallFilter()
    assert h.push("Hello ") == "Hello " and h.push("<tool_call>{") == "" and h.calling


def test_a_template_without_a_tool_format_gets_the_tools_in_the_system_message():
    spec = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    history = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "content": "cold", "tool_call_id": "c1"},
    ]
    out = tools.messages_without_tool_format(history, spec)
    assert out[0]["role"] == "system" and "get_weather" in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert out[2]["content"] == '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    assert out[3] == {"role": "tool", "content": "cold"}


def test_logprob_shapes_chat_and_legacy_completions():
    entries = (TokenLogprob(token="Hi", logprob=-0.5, top=(("Hi", -0.5), ("Ho", -1.5))),)
    done = Completion(
        text="Hi",
        finish_reason="length",
        prompt_tokens=1,
        completion_tokens=1,
        first_token_at=None,
        logprobs=entries,
        prompt_logprobs=(TokenLogprob(token="A", logprob=None),),
        prompt_text="A",
    )
    env = fmt.Envelope(kind="completions", model="m")
    body = fmt.full_response(env, [fmt.Choice(completion=done, content="Hi", echo=True)])["choices"][0]
    assert body["text"] == "AHi"
    assert body["logprobs"] == {
        "tokens": ["A", "Hi"],
        "token_logprobs": [None, -0.5],
        "top_logprobs": [None, {"Hi": -0.5, "Ho": -1.5}],
        "text_offset": [0, 1],
    }
    chat = fmt.full_response(fmt.Envelope(kind="chat", model="m"), [fmt.Choice(completion=done, content="Hi")])
    entry = chat["choices"][0]["logprobs"]["content"][0]
    assert entry["bytes"] == [72, 105] and entry["top_logprobs"][1] == {
        "token": "Ho",
        "logprob": -1.5,
        "bytes": [72, 111],
    }
