"""What crosses from the HTTP layer to the model worker: prepared inputs (units) and what
comes back. An engine turns a request part into a unit (`prepare_*`, in a thread pool: tokenising,
decoding images) and runs a list of units as one batch (in the worker thread)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    pass

Route = Literal["chat", "completions", "embeddings", "classify"]

ROUTES_OF_TASK: dict[str, frozenset[Route]] = {
    "text-generation": frozenset({"chat", "completions"}),
    "image-text-to-text": frozenset({"chat", "completions"}),
    "feature-extraction": frozenset({"embeddings"}),
    "image-classification": frozenset({"classify"}),
}


class PayloadTooLarge(ValueError):
    """An input past a limit of this server (the KV cache, --max-tokens): the server answers 413."""


class FieldNotSupported(ValueError):
    """A request field this engine cannot honour (a sampling rule its runtime lacks): the server
    answers 400 naming the field, rather than ignoring it."""


class ContextTooLong(ValueError):
    """An input longer than the model takes: the server answers 400 with both lengths, unless
    the request asked to truncate it."""


def check_token_ids(ids: Sequence[int], vocab_size: int | None, *, name: str) -> None:
    """ValueError (422) naming the first token id outside the model's vocabulary."""
    if vocab_size is None:
        return
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise ValueError(
            f"token id {bad} is outside the vocabulary of {name}: ids run from 0 to {vocab_size - 1}; "
            "send ids from this model's tokenizer, or send text"
        )


# -- generation ---------------------------------------------------------------------------
SAMPLING_EPS = 1e-5  # temperatures below it are greedy (vLLM's _SAMPLING_EPS)


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    """One sequence's sampling and stopping rules (what `runner.sampling` applies per row)."""

    max_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None  # a sampled request with a seed repeats itself (continuous scheduler)
    top_k: int = 0  # keep the k most likely tokens; 0: all
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and the output (HF/CTRL rule)
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    stop_token_ids: tuple[int, ...] = ()  # more tokens that end the sequence (beside end-of-sequence)
    min_tokens: int = 0  # end-of-sequence, stop tokens and stop strings only after this many tokens
    ignore_eos: bool = False  # end-of-sequence never ends it (nor is sampled): exactly max_tokens come
    logprobs: int | None = None  # the chosen token's log-probability and this many alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token (completions' echo)
    grammar: str | None = None  # an llguidance grammar the output must follow (JSON schema, tool calls)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be 1 or more")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} is more than max_tokens={self.max_tokens}; lower it")

    @property
    def greedy(self) -> bool:
        """A temperature below SAMPLING_EPS is greedy (vLLM's rule: dividing logits by it would overflow)."""
        return self.temperature < SAMPLING_EPS


@dataclass(frozen=True, kw_only=True, slots=True)
class Prompt:
    """A prompt ready for the model. Text models carry token ids; vision-language models carry
    the templated text and images, which their processor turns into tensors per batch."""

    ids: tuple[int, ...] = ()
    text: str | None = None
    images: tuple[Any, ...] = ()
    media: tuple[Any, ...] = ()  # the images as the continuous steps take them (runner.vision.ImageInput)
    prompt_tokens: int
    truncated: int = 0  # leading tokens dropped to fit the context (the request asked to truncate)

    @property
    def batch_key(self) -> str:
        # prompts with images and prompts without go through different model inputs
        return "generate:vision" if self.images else "generate"


@dataclass(kw_only=True, slots=True, eq=False)
class GenUnit:
    """One sequence to generate. `on_text` receives each new piece of text, in the worker
    thread; the handler sets `cancelled` when its client went away (the row then stops).
    `sampler` (an `runner.sampling.SequenceSampler`) holds its per-sequence sampling state;
    `fork_of`: another choice of the same prompt (n > 1), whose prefilled KV this one may share."""

    prompt: Prompt
    params: SamplingParams
    on_text: Callable[[str], None] = lambda text: None
    sampler: Any = None
    fork_of: GenUnit | None = None
    sampled: list[Any] = field(default_factory=list)  # its SampledTokens so far, when params.logprobs is set
    prompt_sampled: list[Any] | None = None  # the prompt's SampledTokens, when params.prompt_logprobs is set
    cancelled: bool = False
    emitted: bool = False  # some text went out: the worker must not replay this unit
    first_token_at: float | None = None  # time.monotonic()
    tokens: int = 0

    def note_token(self, now: float) -> None:
        self.tokens += 1
        if self.first_token_at is None:
            self.first_token_at = now

    def emit(self, text: str) -> None:
        if text:
            self.emitted = True
            self.on_text(text)


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenLogprob:
    """One token's log-probability under the model (log_softmax of its raw logits), with the
    most likely alternatives at that position, best first."""

    token: str
    logprob: float | None  # None: the first prompt token (nothing before it to predict it)
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class Completion:
    text: str
    finish_reason: Literal["stop", "length"]
    prompt_tokens: int
    completion_tokens: int
    first_token_at: float | None
    finished_at: float = field(default_factory=time.monotonic)
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per output token (params.logprobs)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None  # per prompt token (echo)
    prompt_text: str | None = None  # the prompt as text (echo)


@dataclass(frozen=True, kw_only=True, slots=True)
class StepInput:
    """Tokens `start ..` of sequence `seq_id`, fed to the model in one continuous-batching step.
    With `sample`, the chunk ends at the sequence's last known token: the engine picks the next."""

    seq_id: int
    start: int
    tokens: tuple[int, ...]
    sample: bool
    params: SamplingParams
    sampler: Any = None  # the sequence's SequenceSampler (None: a fresh one from params, e.g. in checks)
    blocks: tuple[int, ...] = ()  # its KV blocks, position order (engines that keep KV in the scheduler's pool)
    images: tuple[Any, ...] = ()  # its prompt's images (runner.vision.ImageInput), on chunks of the prompt


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences share (prefix caches look for the longest)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class StepEngine(Protocol):
    """A model that decodes many sequences step by step, each with its own KV cache entries
    (the continuous scheduler drives it; see `accelab.serve.continuous`). `step` must be
    idempotent for a chunk: running the same chunk again overwrites its positions."""

    name: str  # what it is, for the start-up log
    kv_bytes_per_token: int  # KV cache bytes one token of one sequence holds

    # One SampledToken (runner.sampling) per input with `sample`, in order: the engine hands
    # the [N, V] logits rows of those inputs to `runner.sampling.sample_step(logits, inputs)`,
    # which applies each sequence's own rules (StepInput.sampler) and returns them.
    def step(self, inputs: list[StepInput]) -> list[Any]: ...

    def release(self, seq_id: int) -> None: ...  # the sequence ended: free its cache entries

    def close(self) -> None: ...


# What a StepEngine may do besides stepping, each a protocol of its own: the continuous worker
# asks `isinstance(engine, SupportsFork)` and so on once, when it starts.
@runtime_checkable
class SupportsPrefixReuse(Protocol):
    """A prefix cache of the engine's own: a new sequence takes the KV of its first n tokens
    from a finished sequence that began the same way; returns n."""

    def reuse_prefix(self, seq_id: int, tokens: Sequence[int]) -> int: ...


@runtime_checkable
class SupportsFork(Protocol):
    """n > 1 choices of one prompt prefill it once: the new sequence child starts with the KV of
    the parent's first n_tokens positions. The parent is running; the child's next chunk starts
    at n_tokens."""

    def fork(self, parent_seq_id: int, child_seq_id: int, n_tokens: int) -> None: ...


@runtime_checkable
class SupportsScore(Protocol):
    """Prompt log-probabilities (completions' echo): the logits [len(tokens), V] of every position."""

    def score(self, tokens: Sequence[int]) -> Any: ...


@runtime_checkable
class PagedKV(Protocol):
    """Its KV lives in the scheduler's blocks (StepInput.blocks): the scheduler runs the prefix
    cache and forks by block ids (so the pool's prefix cache is real), and the engine copies a
    shared block before a chunk writes into it (`Step.copies`, before the step's chunks run)."""

    def copy_blocks(self, copies: Sequence[Any]) -> None: ...


@runtime_checkable
class EncodesAhead(Protocol):
    """A vision-language model's engine that encodes images between the steps, in slices: the
    scheduler holds a prefill chunk before an image until `image_ready`, and the worker gives
    the encoder a slice after each step (`encode_ahead`; runner.encoder_slices)."""

    encodes_ahead: bool  # False: this model's images are encoded inside the steps

    def image_ready(self, key: Any) -> bool: ...

    def encode_ahead(
        self,
        wanted: Sequence[tuple[int, Any]],
        budget_s: float | None,
        *,
        batch: int = 1,
        interrupt: Callable[[], bool] | None = None,
    ) -> dict[str, BaseException]: ...


@dataclass(frozen=True, slots=True)
class StepCost:
    """The least work a step must do: bytes read from memory (every weight once, each
    sequence's KV once) and FLOPs (2 per multiply-add of the GEMMs and attention)."""

    bytes_read: float
    flops: float


@runtime_checkable
class CostsSteps(Protocol):
    """The engine knows what a step costs the machine, so /metrics can say how close each step
    came to this machine's bound (`accelab.serve.machine_bound`)."""

    precision: str  # the compute path whose peak FLOP/s bounds it ("fp32", "bf16")

    def step_cost(self, inputs: Sequence[Any]) -> StepCost: ...  # each with start, tokens, sample


def fit_prompt(prompt: Prompt, max_tokens: int, max_context: int | None, *, truncate: bool, name: str) -> Prompt:
    """The prompt, if it and max_tokens fit the model's context; with `truncate`, its last
    tokens that do; else ContextTooLong with both lengths."""
    if not max_context or prompt.prompt_tokens + max_tokens <= max_context:
        return prompt
    room = max_context - max_tokens
    if room < 1:
        raise ContextTooLong(
            f"max_tokens ({max_tokens}) leaves no room for a prompt in {name}'s context of "
            f"{max_context} tokens; lower max_tokens"
        )
    if truncate and prompt.ids and not prompt.images:
        dropped = prompt.prompt_tokens - room
        return Prompt(ids=prompt.ids[dropped:], prompt_tokens=room, truncated=dropped)
    advice = (
        f"lower max_tokens to {max_context - prompt.prompt_tokens}"
        if prompt.prompt_tokens < max_context
        else "shorten the prompt"
    )
    raise ContextTooLong(
        f"prompt ({prompt.prompt_tokens} tokens) + max_tokens ({max_tokens}) is more than {name}'s context of "
        f'{max_context} tokens; {advice}, or send "truncate": true to keep the prompt\'s last {room} tokens'
    )


# -- embeddings and classification ----------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class TextInput:
    ids: tuple[int, ...]
    truncated: int = 0  # trailing tokens dropped to fit the model's window (the request asked to truncate)

    @property
    def tokens(self) -> int:
        return len(self.ids)


@dataclass(frozen=True, kw_only=True, slots=True)
class ImageInput:
    pixels: Any  # [3, H, W] tensor from the model's image processor
    top_k: int = 5


@dataclass(frozen=True, kw_only=True, slots=True)
class Label:
    label: str
    score: float


# -- what a serving worker reports after each step (the metrics' side) ---------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class StepReport:
    """What one step did, for the metrics."""

    running: int
    waiting: int
    kv_used: int  # blocks
    kv_free: int
    tokens: int  # tokens fed to the model
    sampled: int  # tokens generated
    preempted: int
    seconds: float
    reused_tokens: int = 0  # prompt tokens this step's admissions took from the engine's prefix cache
    kv_cached: int = 0  # free blocks still holding a prefix a later sequence may take (prefix caching)
    kv_block_bytes: int = 0  # bytes of one block in the engine's cache (all layers, keys and values)
    batch: int = 0  # sequences fed to the model in this step
    preempted_tokens: int = 0  # tokens of the sequences preempted: fed to the model again at readmission
    cost: StepCost | None = None  # what the step must read and compute (engines that say: CostsSteps)
    images: Any = None  # its image work (runner.vision.ImageCounts) where the engine encodes images


@dataclass(kw_only=True, slots=True)
class ContinuousHooks:
    on_step: Callable[[StepReport], None] = lambda report: None
    on_token_gap: Callable[[float], None] = lambda seconds: None  # inter-token latency of one sequence
    on_retry: Callable[[str], None] = lambda reason: None  # a failed step run again sequence by sequence
