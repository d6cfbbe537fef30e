"""Tool calls: how the model is told about tools, the grammar its answer follows, and how a
call is read back out of the text.

The call format is the `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block that
most chat templates with tools use (Hermes, Qwen, SmolLM3). A template that renders tools
itself gets them through `apply_chat_template(tools=...)` (its own tool format, with earlier
calls and tool results in its own shape). A template without a tool format (SmolLM2's: it
renders role and content only) gets `tool_system_text` added to the system message, earlier
calls written out as `<tool_call>` blocks, and tool results as `tool` turns.

Decoding is constrained per sequence (llguidance, `structured`): tool_choice "required" or a
named function allows only a call to those tools, with arguments that validate against the
function's parameters; "auto" allows either a call or text that does not begin with "<"
(so text that starts a call must finish it); "none" constrains nothing.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from accelab.serve import structured

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def tool_specs(tools: list[Any]) -> list[dict[str, Any]]:
    """The request's tools as plain dicts (OpenAI's shape)."""
    return [{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in tools]


def tool_system_text(specs: list[dict[str, Any]]) -> str:
    lines = [
        "You can call these tools. To call one, answer with only",
        f'{OPEN}{{"name": <tool name>, "arguments": <arguments as a JSON object>}}{CLOSE}',
        "Tools:",
    ]
    lines += [json.dumps(spec["function"]) for spec in specs]
    return "\n".join(lines)


def template_renders_tools(tokenizer: Any) -> bool:
    """True when the chat template writes the tools into the prompt itself."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return False
    probe = [{"type": "function", "function": {"name": "zq_probe_tool", "parameters": {"type": "object"}}}]
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tools=probe, tokenize=False, add_generation_prompt=True
        )
    except Exception:  # noqa: BLE001 - a template that fails on tools has no tool format
        return False
    return "zq_probe_tool" in text


def messages_without_tool_format(messages: list[dict[str, Any]], specs: list[dict[str, Any]] | None) -> list[dict]:
    """Messages for a template that knows only role and content: the tools go into the system
    message, earlier calls become <tool_call> blocks, tool results stay `tool` turns."""
    out = []
    for m in messages:
        content = m["content"]
        if m.get("tool_calls"):
            calls = [
                OPEN
                + json.dumps({"name": c["function"]["name"], "arguments": _loads(c["function"]["arguments"])})
                + CLOSE
                for c in m["tool_calls"]
            ]
            content = ((content + "\n") if isinstance(content, str) and content else "") + "\n".join(calls)
        out.append({"role": m["role"], "content": content})
    if specs:
        text = tool_system_text(specs)
        if out and out[0]["role"] in ("system", "developer") and isinstance(out[0]["content"], str):
            out[0] = {"role": out[0]["role"], "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def messages_for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template with a tool format: arguments as objects (what templates expect)."""
    out = []
    for message in messages:
        m = dict(message)
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {
                    "type": "function",
                    "id": c["id"],
                    "function": {"name": c["function"]["name"], "arguments": _loads(c["function"]["arguments"])},
                }
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


def tool_grammar(specs: list[dict[str, Any]], choice: Any, text_schema: dict[str, Any] | None = None) -> str | None:
    """The llguidance grammar of an answer under tool_choice `choice` ("auto", "required", or
    a function name); None when nothing is constrained. `text_schema`: a JSON schema the
    non-call answer must follow (response_format beside tools)."""
    if choice == "none":
        return None
    names = [s["function"]["name"] for s in specs] if choice in ("auto", "required", None) else [choice]
    options = []
    for spec in specs:
        fn = spec["function"]
        if fn["name"] in names:
            options.append(
                {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name", "arguments"],
                    "properties": {
                        "name": {"const": fn["name"]},
                        "arguments": fn.get("parameters") or {"type": "object"},
                    },
                }
            )
    call = options[0] if len(options) == 1 else {"anyOf": options}
    rules = [f"tool_reply: {json.dumps(OPEN)} call {json.dumps(CLOSE)}", f"call: {structured.json_in_lark(call)}"]
    if choice in ("auto", None):
        text = structured.json_in_lark(text_schema) if text_schema is not None else r"/(?s:[^<].*)/"
        rules = ["start: tool_reply | text_reply", f"text_reply: {text}"] + rules
    else:
        rules = ["start: tool_reply"] + rules
    return structured.lark_grammar("\n".join(rules))


@dataclass(frozen=True, kw_only=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text
    id: str

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            out["index"] = index
        return out


def parse_calls(text: str) -> tuple[str | None, list[ParsedCall]]:
    """(content before the first call or None, the calls) of an answer; no calls: (text, [])."""
    calls, rest = [], text
    start = rest.find(OPEN)
    if start < 0:
        return text, []
    content = text[:start].strip() or None
    while start >= 0:
        end = rest.find(CLOSE, start)
        body = rest[start + len(OPEN) : end if end >= 0 else len(rest)]
        try:
            value = json.loads(body)
        except ValueError:
            break
        if isinstance(value, dict) and isinstance(value.get("name"), str):
            args = value.get("arguments", value.get("parameters", {}))
            calls.append(ParsedCall(name=value["name"], arguments=json.dumps(args), id="call_" + uuid.uuid4().hex[:24]))
        if end < 0:
            break
        rest = rest[end + len(CLOSE) :]
        start = rest.find(OPEN)
    return (content, calls) if calls else (text, [])


class CallFilter:
    """Streamed text of an answer that may be a tool call: text goes out as it comes, except
    while it could still be the start of a call (held back), and nothing after a call began."""

    def __init__(self) -> None:
        self.text = ""
        self.sent = 0
        self.calling = False

    def push(self, piece: str) -> str:
        self.text += piece
        if self.calling:
            return ""
        stripped = self.text.lstrip()
        if stripped.startswith(OPEN):
            self.calling = True
            return ""
        if OPEN.startswith(stripped):  # could still become a call
            return ""
        out, self.sent = self.text[self.sent :], len(self.text)
        if OPEN in out:  # a call after some text: the text before it goes, the call is held
            cut = out.index(OPEN)
            self.calling, self.sent = True, self.sent - len(out) + cut
            return out[:cut]
        return out


def _loads(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
