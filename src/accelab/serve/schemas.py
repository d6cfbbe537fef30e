"""Request bodies of the OpenAI-compatible routes (pydantic). A body that does not fit gets
422 with a message naming the field (see `errors.validation_message`). Fields OpenAI clients
send that this server does not use (user, logprobs=false, ...) are accepted and ignored. `seed`
makes a sampled request repeatable under the continuous scheduler (the per-batch one samples
all rows of a batch from one generator, so there it cannot)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


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


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def to_engine(self) -> dict:
        if self.content is None or isinstance(self.content, str):
            return {"role": self.role, "content": self.content or ""}
        parts = [{"type": "text", "text": p.text} if isinstance(p, TextPart)
                 else {"type": "image", "url": p.image_url.url} for p in self.content]
        return {"role": self.role, "content": parts}


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    truncate: bool = False  # a prompt too long for the context keeps its last tokens instead of a 400
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"n={n} is not supported: this server returns one choice per prompt; send n=1 "
                             "(or several requests)")
        return n

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > 4:
            raise ValueError(f"at most 4 stop sequences (got {len(stop)})")
        return stop

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @property
    def requested_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions

    @model_validator(mode="after")
    def _not_empty(self) -> "CompletionRequest":
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt is an empty list; send a string or a list of strings")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]  # one prompt given as token ids
        return list(self.prompt)

    @property
    def requested_tokens(self) -> int | None:
        return self.max_tokens


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
        if all(isinstance(i, int) for i in self.input):
            return [list(self.input)]
        return list(self.input)


class ClassifyRequest(_Body):
    """`{"images": ["data:image/png;base64,...", ...], "top_k": 5}` (or one `"image"`)."""

    model: str | None = None
    images: list[str] | None = None
    image: str | None = None
    top_k: int = Field(5, ge=1, le=1000)

    @model_validator(mode="after")
    def _one_of(self) -> "ClassifyRequest":
        if (self.images is None) == (self.image is None):
            raise ValueError('send either "image": "<base64>" or "images": ["<base64>", ...]')
        if self.images is not None and not self.images:
            raise ValueError('"images" is an empty list')
        return self

    @property
    def all_images(self) -> list[str]:
        return self.images if self.images is not None else [self.image]  # type: ignore[list-item]
