"""Request bodies of the OpenAI-compatible routes (pydantic). A body that does not fit gets
422 with a message naming the field (see `errors.validation_message`). A top-level field of a
generation request that this server does not know, or knows and does not honour, is a 400
that names it and says what to send instead (`unsupported_fields`): nothing is silently
ignored. `user` is accepted (an end-user tag: it changes nothing generated). `seed` makes a
sampled request repeatable (per choice: choice i draws from seed + i)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_CHOICES = 16  # n
MAX_TOP_LOGPROBS = 20

# fields peers take that this server does not honour, and what to send instead
_NOT_HONOURED = {
    "functions": "send tools (the functions API is deprecated)",
    "function_call": "send tool_choice with tools (the functions API is deprecated)",
    "best_of": "beam search and best-of are not supported; send n for several choices",
    "use_beam_search": "beam search is not supported; remove it",
    "length_penalty": "beam search is not supported; remove it",
    "guided_json": 'send response_format {"type": "json_schema", ...}',
    "guided_regex": "regular-expression constraints are not supported; send response_format with a JSON schema",
    "guided_choice": 'send response_format {"type": "json_schema"} with an "enum" schema',
    "guided_grammar": "grammars are not supported; send response_format with a JSON schema",
    "structured_outputs": 'send response_format {"type": "json_schema", ...}',
    "suffix": "fill-in-the-middle (suffix) is not supported; remove it",
    "prompt_logprobs": "send echo: true with logprobs on /v1/completions",
    "echo": "echo is a field of /v1/completions, not of chat",
    "store": "this server stores no completions; remove it",
    "metadata": "this server stores no completions (metadata goes with store); remove it",
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class _Request(BaseModel):
    """A top-level generation body: unknown fields are kept, to be refused by name."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)


def unsupported_fields(body: BaseModel) -> list[tuple[str, str]]:
    """(field, what to do) for every top-level field the server will not honour."""
    extra = body.model_extra or {}
    out = []
    for name, value in extra.items():
        if value is None or (name in ("store", "echo") and value is False):
            continue  # an explicit null (or store: false) asks for nothing
        if name == "best_of" and value in (1, getattr(body, "n", 1)):
            continue  # best_of == n is the plain case
        out.append((name, _NOT_HONOURED.get(name, "this server does not support it; remove it")))
    return out


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImageURL(_Body):
    url: str
    detail: str | None = None


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call

    def to_engine(self) -> dict:
        out: dict[str, Any]
        if self.content is None or isinstance(self.content, str):
            out = {"role": self.role, "content": self.content or ""}
        else:
            parts = [
                {"type": "text", "text": p.text}
                if isinstance(p, TextPart)
                else {"type": "image", "url": p.image_url.url}
                for p in self.content
            ]
            out = {"role": self.role, "content": parts}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage so far in every chunk (vLLM's field; guidellm sends it)


class JSONSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced (strict or not)


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError('response_format of type "json_schema" needs json_schema: {"name": ..., "schema": {...}}')
        return self


class FunctionDef(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class _Sampling(_Request):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    seed: int | None = None
    truncate: bool = False  # a prompt too long for the context keeps its last tokens instead of a 400
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user tag (OpenAI's): accepted, it changes nothing generated
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (as text) -> -100 .. 100
    # vLLM's sampling fields
    top_k: int = Field(0, ge=-1)  # 0 or -1: off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    # from 0.01: a smaller one would divide seen tokens' logits past float32's range
    repetition_penalty: float = Field(1.0, ge=0.01, le=10.0)
    stop_token_ids: list[int] | None = None
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > 4:
            raise ValueError(f"at most 4 stop sequences (got {len(stop)})")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not key.lstrip("-").isdecimal():  # "²".isdigit() is True, but int("²") fails
                raise ValueError(f'logit_bias keys are token ids (got {key!r}); send {{"1234": -100}}')
            if not -100 <= value <= 100:
                raise ValueError(f"logit_bias values run from -100 to 100 (got {value} for token {key})")
        return bias

    @property
    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items())

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # allowed; the server makes at most one call per answer

    @model_validator(mode="after")
    def _consistent(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError(f"top_logprobs={self.top_logprobs} needs logprobs: true")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise ValueError('tool_choice needs tools; send tools: [{"type": "function", ...}]')
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if self.tool_choice.function.name not in names:
                raise ValueError(
                    f"tool_choice names {self.tool_choice.function.name!r}, which is not among the "
                    f"tools ({', '.join(names)})"
                )
        return self

    @property
    def requested_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _not_empty(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt is an empty list; send a string or a list of strings")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        return _one_per_item(self.prompt)

    @property
    def requested_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def logprob_count(self) -> int | None:
        return self.logprobs


class EmbeddingRequest(_Body):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    truncate: bool = False  # an input longer than the model's window keeps its first tokens instead of a 400

    @property
    def inputs(self) -> list[str | list[int]]:
        if isinstance(self.input, str):
            return [self.input]
        if not self.input:
            raise ValueError("input is an empty list; send a string or a list of strings")
        return _one_per_item(self.input)


def _one_per_item(value: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """A string, a list of strings, one list of token ids or a list of them: one item each (the
    lists are of one kind: the request's validation took one member of the union)."""
    if isinstance(value, str):
        return [value]
    if all(isinstance(item, int) for item in value):
        return [[item for item in value if isinstance(item, int)]]  # one prompt given as token ids
    return [item for item in value if not isinstance(item, int)]


class ClassifyRequest(_Body):
    """`{"images": ["data:image/png;base64,...", ...], "top_k": 5}` (or one `"image"`)."""

    model: str | None = None
    images: list[str] | None = None
    image: str | None = None
    top_k: int = Field(5, ge=1, le=1000)

    @model_validator(mode="after")
    def _one_of(self) -> ClassifyRequest:
        if (self.images is None) == (self.image is None):
            raise ValueError('send either "image": "<base64>" or "images": ["<base64>", ...]')
        if self.images is not None and not self.images:
            raise ValueError('"images" is an empty list')
        return self

    @property
    def all_images(self) -> list[str]:
        if self.images is not None:
            return self.images
        assert self.image is not None, "the validator takes exactly one of image and images"
        return [self.image]
