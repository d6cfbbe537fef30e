"""Response bodies in OpenAI's shapes (chat, completions, their stream chunks, embeddings)."""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from accelab.serve.engines.base import Completion, TokenLogprob


@dataclass(frozen=True, kw_only=True, slots=True)
class Envelope:
    """What every chunk of one response shares: one id per response (and per stream)."""

    kind: str  # "chat" | "completions"
    model: str
    truncated: int = 0  # prompt tokens dropped to fit the context (the request asked to truncate)
    n: int = 1  # choices per prompt: the completions come n to a prompt, whose tokens count once
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def head(self, obj: str) -> dict[str, Any]:
        prefix = "chatcmpl-" if self.kind == "chat" else "cmpl-"
        return {"id": prefix + self.id, "object": obj, "created": self.created, "model": self.model}


def usage(completions: Sequence[Completion], truncated: int = 0, n: int = 1) -> dict[str, int]:
    """OpenAI's usage: each prompt's tokens once (the n choices of a prompt share it), every
    choice's completion tokens."""
    prompt = sum(c.prompt_tokens for c in completions[::n])
    generated = sum(c.completion_tokens for c in completions)
    counts = {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}
    if truncated:
        counts["truncated_tokens"] = truncated
    return counts


@dataclass(frozen=True, kw_only=True, slots=True)
class Choice:
    """One choice as the response shows it: content or tool calls, and its log-probabilities."""

    completion: Completion
    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    echo: bool = False  # completions: the prompt goes before the text (and its log-probabilities)

    @property
    def finish_reason(self) -> str:
        return "tool_calls" if self.tool_calls else self.completion.finish_reason


def chat_logprobs(entries: Sequence[TokenLogprob | None] | None) -> dict[str, Any] | None:
    """Chat's shape: every entry is an output token's (only a prompt's first token has none)."""
    if entries is None:
        return None
    return {"content": [_chat_entry(e) for e in entries if e is not None], "refusal": None}


def _chat_entry(e: TokenLogprob) -> dict[str, Any]:
    return {
        "token": e.token,
        "logprob": e.logprob,
        "bytes": list(e.token.encode()),
        "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in e.top],
    }


def completion_logprobs(entries: Sequence[TokenLogprob | None], offset: int = 0) -> dict[str, Any]:
    """The legacy shape: parallel lists; a None entry (the first prompt token) has nulls."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for e in entries:
        offsets.append(offset)
        if e is None:
            tokens.append("")
            values.append(None)
            tops.append(None)
            continue
        tokens.append(e.token)
        values.append(e.logprob)
        tops.append(None if e.logprob is None else {t: v for t, v in e.top})
        offset += len(e.token)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _completion_choice(index: int, choice: Choice) -> dict[str, Any]:
    c = choice.completion
    text = (c.prompt_text or "") + c.text if choice.echo else c.text
    logprobs = None
    if c.logprobs is not None or (choice.echo and c.prompt_logprobs is not None):
        entries = (list(c.prompt_logprobs or ()) if choice.echo else []) + list(c.logprobs or ())
        logprobs = completion_logprobs(entries)
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": choice.finish_reason}


def full_response(env: Envelope, choices: Sequence[Choice]) -> dict[str, Any]:
    completions = [c.completion for c in choices]
    if env.kind == "chat":
        body = []
        for i, ch in enumerate(choices):
            message: dict[str, Any] = {"role": "assistant", "content": ch.content}
            if ch.tool_calls:
                message["tool_calls"] = ch.tool_calls
            body.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": chat_logprobs(ch.completion.logprobs),
                    "finish_reason": ch.finish_reason,
                }
            )
        return {**env.head("chat.completion"), "choices": body, "usage": usage(completions, env.truncated, env.n)}
    body = [_completion_choice(i, ch) for i, ch in enumerate(choices)]
    return {**env.head("text_completion"), "choices": body, "usage": usage(completions, env.truncated, env.n)}


def chunk(
    env: Envelope,
    index: int,
    text: str | None = None,
    *,
    role: bool = False,
    finish_reason: str | None = None,
    usage_: dict[str, int] | None = None,
    logprobs: Sequence[TokenLogprob | None] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    if env.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": chat_logprobs(logprobs),
            "finish_reason": finish_reason,
        }
        body = {**env.head("chat.completion.chunk"), "choices": [choice]}
    else:
        choice = {
            "index": index,
            "text": text or "",
            "logprobs": None if logprobs is None else completion_logprobs(logprobs),
            "finish_reason": finish_reason,
        }
        body = {**env.head("text_completion"), "choices": [choice]}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def usage_chunk(env: Envelope, completions: Sequence[Completion]) -> dict[str, Any]:
    """The last chunk when stream_options.include_usage: no choices, the whole stream's usage."""
    obj = "chat.completion.chunk" if env.kind == "chat" else "text_completion"
    return {**env.head(obj), "choices": [], "usage": usage(completions, env.truncated, env.n)}


def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"


def embedding_item(index: int, vector: Any, encoding: str) -> dict[str, Any]:
    """`vector`: a list of floats or a float array, [D]."""
    if encoding == "base64":  # little-endian float32, what the openai client decodes
        value: Any = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    else:
        value = vector.tolist() if isinstance(vector, np.ndarray) else list(vector)
    return {"object": "embedding", "index": index, "embedding": value}
