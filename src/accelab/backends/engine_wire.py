"""What crosses between accelab and an engine process in a venv of its own (vLLM's, OpenVINO
GenAI's): small typed messages, one JSON object a line over a Unix socket.

Both sides import this module: accelab as `accelab.backends.engine_wire`, the engine process (in
a venv which has no accelab) by file path. Standard library only. Token ids travel, never
text: accelab tokenises with the model's own tokenizer and decodes what comes back, so stop
strings, streaming text and the token counts are the same code as for every other engine.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    """How the vLLM engine process builds vLLM's engine (its AsyncEngineArgs); None: vLLM's default."""

    model: str  # a directory in the Hugging Face layout
    device: str = "cpu"  # cpu | cuda
    dtype: str = "float32"
    enforce_eager: bool = True
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    prefix_caching: bool = False
    max_model_len: int | None = None
    kv_cache_bytes: int | None = None  # GPU: vLLM's kv_cache_memory_bytes (CPU sizes it from the environment)
    keep_s: float = 0.0  # exit this long after the last client left (0: at once)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        return cls(**json.loads(text))


@dataclass(frozen=True, kw_only=True, slots=True)
class OvEngineConfig:
    """How the OpenVINO GenAI engine process builds its ContinuousBatchingPipeline."""

    model: str  # the OpenVINO export (openvino_model.xml and the tokenizer models beside it)
    precision: str = "f32"  # INFERENCE_PRECISION_HINT: f32 | bf16
    kv_precision: str = "f32"  # KV_CACHE_PRECISION: f32 | bf16 | u8
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_bytes: int = 2**30  # the pool, in whole blocks of 32 tokens
    prefix_caching: bool = False
    threads: int | None = None  # INFERENCE_NUM_THREADS; None: OpenVINO's (every core)
    keep_s: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> OvEngineConfig:
        return cls(**json.loads(text))


# -- accelab -> engine -------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class Submit:
    """Generate for one prompt; the engine answers with Tokens messages, the last one finished."""

    id: str
    prompt_ids: list[int]
    max_tokens: int
    min_tokens: int = 0
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    top_k: int = 0  # 0: all
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: list[list[float]] = field(default_factory=list)  # [token id, bias] pairs
    stop_token_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True, slots=True)
class Abort:
    id: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Score:
    """The log-probability of every prompt token after the first (perplexity), and with top_k > 0
    also the engine's top_k log-probabilities at each of those positions (the quality guard's KL
    divergence); answered by Scored."""

    id: str
    prompt_ids: list[int]
    top_k: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class Watch:
    """Send Stats after every engine step from now on (the server's /metrics)."""


# -- engine -> accelab -------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class Info:
    """The engine's answer to a new connection: what it runs and its capacity."""

    model: str
    version: str  # of the runtime
    pid: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    kv_blocks: int  # KV-cache blocks vLLM allocated (its capacity is kv_blocks x block_size tokens)
    dtype: str
    enforce_eager: bool
    prefix_caching: bool
    load_s: float  # engine start to ready (weights, KV cache, compile)
    runtime: str = "vLLM"  # who schedules the steps: vLLM, OpenVINO GenAI
    refuses: list[str] = field(default_factory=list)  # Submit fields its sampler lacks (sent: a 400 names them)


@dataclass(frozen=True, kw_only=True, slots=True)
class Tokens:
    """New tokens of one request; `finished` ("stop", "length", "abort") on its last message."""

    id: str
    tokens: list[int]
    finished: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Scored:
    id: str
    logprobs: list[float]  # [len(prompt) - 1]: log p(token i | tokens < i), i >= 1
    # Score.top_k > 0: per position i >= 1, the most likely ids (first the likeliest) and their
    # log-probabilities, as many as the engine gives (vLLM: up to its max_logprobs)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True, slots=True)
class Failed:
    id: str
    error: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Stats:
    """The engine's scheduler after one step."""

    running: int
    waiting: int
    kv_usage: float  # fraction of KV blocks in use
    preempted: int = 0
    prefix_hit_tokens: int = 0
    seconds: float | None = None  # the step's own time, where the engine measures it (else the gap between two)


Message = Submit | Abort | Score | Watch | Info | Tokens | Scored | Failed | Stats
KINDS: dict[str, type] = {
    cls.__name__: cls for cls in (Submit, Abort, Score, Watch, Info, Tokens, Scored, Failed, Stats)
}


def encode(message: Any) -> bytes:
    return (json.dumps({"kind": type(message).__name__, **asdict(message)}, separators=(",", ":")) + "\n").encode()


def decode(line: bytes | str) -> Any:
    data = json.loads(line)
    kind = KINDS.get(data.pop("kind", None))
    if kind is None:
        raise ValueError(f"unknown engine message {line[:80]!r}")
    names = {f.name for f in fields(kind)}
    return kind(**{k: v for k, v in data.items() if k in names})
