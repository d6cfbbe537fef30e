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

from accelab.serve.engines.base import Completion


@dataclass(frozen=True, kw_only=True, slots=True)
class Envelope:
    """What every chunk of one response shares: one id per response (and per stream)."""

    kind: str  # "chat" | "completions"
    model: str
    truncated: int = 0  # prompt tokens dropped to fit the context (the request asked to truncate)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def head(self, obj: str) -> dict[str, Any]:
        prefix = "chatcmpl-" if self.kind == "chat" else "cmpl-"
        return {"id": prefix + self.id, "object": obj, "created": self.created, "model": self.model}


def usage(completions: Sequence[Completion], truncated: int = 0) -> dict[str, int]:
    prompt = sum(c.prompt_tokens for c in completions)
    generated = sum(c.completion_tokens for c in completions)
    counts = {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}
    if truncated:
        counts["truncated_tokens"] = truncated
    return counts


def full_response(env: Envelope, completions: Sequence[Completion]) -> dict[str, Any]:
    if env.kind == "chat":
        choices = [{"index": i, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
                    "finish_reason": c.finish_reason} for i, c in enumerate(completions)]
        return {**env.head("chat.completion"), "choices": choices, "usage": usage(completions, env.truncated)}
    choices = [{"index": i, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
               for i, c in enumerate(completions)]
    return {**env.head("text_completion"), "choices": choices, "usage": usage(completions, env.truncated)}


def chunk(env: Envelope, index: int, text: str | None = None, *, role: bool = False,
          finish_reason: str | None = None, usage_: dict[str, int] | None = None) -> dict[str, Any]:
    if env.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        body = {**env.head("chat.completion.chunk"), "choices": [choice]}
    else:
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        body = {**env.head("text_completion"), "choices": [choice]}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def usage_chunk(env: Envelope, completions: Sequence[Completion]) -> dict[str, Any]:
    """The last chunk when stream_options.include_usage: no choices, the whole stream's usage."""
    obj = "chat.completion.chunk" if env.kind == "chat" else "text_completion"
    return {**env.head(obj), "choices": [], "usage": usage(completions, env.truncated)}


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
