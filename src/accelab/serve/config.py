"""ServeConfig: how the server admits, batches and limits requests. No I/O here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from accelab.options import fields_of
from accelab.serve.batcher import BatchPolicy
from accelab.serve.images import ImagePolicy
from accelab.serve.metrics import METRIC_ALIASES, MetricAliases
from accelab.serve.scheduler import SchedulerConfig

Scheduling = Literal["continuous", "static"]
SCHEDULINGS: tuple[Scheduling, ...] = ("continuous", "static")
KV_TOKENS_PER_SEQUENCE = 2048  # the default KV cache: this many tokens for each running sequence
BLOCK_SIZE = 16  # tokens per KV-cache block
# `accelab serve` options named apart from the ServeConfig field they set; every other option
# named like a field sets that field (tests/test_command_options.py checks them against each other)
OPTION_FIELDS: Final = {
    "request_timeout": "request_timeout_s",
    "grace_period": "grace_period_s",
    "image_timeout": "image_timeout_s",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class ServeConfig:
    model_name: str  # the id /v1/models lists and requests name
    plan_name: str = "baseline"
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch_size: int = 32  # inputs per model call; with continuous batching, sequences decoding at once
    max_wait_ms: float = 5.0  # how long the first request of a batch waits for company
    max_queue: int = 256  # requests waiting; more get 429
    request_timeout_s: float = 60.0  # a request still queued after this gets 504
    grace_period_s: float = 30.0  # SIGTERM: time to finish in-flight requests
    max_body_bytes: int = 20 * 1024 * 1024  # larger bodies get 413
    max_tokens: int = 2048  # largest max_tokens a request may ask for (413 above)
    default_max_tokens: int = 256  # chat completions without max_tokens (capped by max_tokens)
    max_inputs: int = 256  # texts, prompts or images in one request (413 above)
    api_key: str | None = None  # when set, API routes need "Authorization: Bearer <key>"
    # generation: "continuous" schedules every decoding step (requests join and leave the running
    # batch); "static" runs one generate call per batch (vision-language models always do)
    scheduler: Scheduling = "continuous"
    max_step_tokens: int | None = None  # tokens per step (decodes + prefill chunks); None: max(256, 2 x batch)
    kv_cache_tokens: int | None = None  # KV-cache capacity; None: 2048 per sequence, at least the model's context
    metric_aliases: MetricAliases = "none"  # "vllm": /metrics also carries vLLM's names (for its dashboards)
    # images in requests (accelab.serve.images): http(s) URLs are fetched from these domains (empty:
    # any public host), never from private or loopback addresses unless allowed
    image_domains: str = ""  # comma-separated
    allow_private_images: bool = False
    image_timeout_s: float = 10.0
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 40_000_000
    max_images: int = 8  # per request (413 above)

    def __post_init__(self) -> None:
        positive = (
            "port",
            "max_batch_size",
            "max_queue",
            "max_body_bytes",
            "max_tokens",
            "default_max_tokens",
            "max_inputs",
            "max_image_bytes",
            "max_image_pixels",
            "max_images",
        )
        for name in positive:
            value = getattr(self, name)
            if value < 1 and not (name == "port" and value == 0):
                raise ValueError(f"{name}={value} must be 1 or more")
        for name in ("max_wait_ms", "request_timeout_s", "grace_period_s", "image_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be 0 or more")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty; give a key or leave it unset")
        if self.metric_aliases not in METRIC_ALIASES:
            raise ValueError(
                f"metric_aliases={self.metric_aliases!r} is not one of {', '.join(METRIC_ALIASES)} "
                "(--metric-aliases vllm adds vLLM's metric names)"
            )
        if self.scheduler not in SCHEDULINGS:
            raise ValueError(f"scheduler={self.scheduler!r} is not one of {', '.join(SCHEDULINGS)}")
        for name in ("max_step_tokens", "kv_cache_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be 1 or more")
        self.scheduler_config(max_context=None)  # its own checks (e.g. step tokens > batch size), now

    @classmethod
    def from_options(
        cls,
        options: Mapping[str, Any],
        *,
        model_name: str,
        plan_name: str,
        plan_settings: Mapping[str, int] | None = None,
        given: frozenset[str] = frozenset(),
    ) -> ServeConfig:
        """The config of `accelab serve`'s options (its parameters by name), for the model and
        plan it serves. `plan_settings` (a tuned Plan's `server`: the settings it was measured
        with) fill the options not in `given` (those the user typed)."""
        merged = {**options, **{k: v for k, v in (plan_settings or {}).items() if k not in given}}
        return cls(model_name=model_name, plan_name=plan_name, **fields_of(cls, merged, renamed=OPTION_FIELDS))

    def image_policy(self) -> ImagePolicy:
        domains = tuple(d.strip().lower().lstrip(".") for d in self.image_domains.split(",") if d.strip())
        return ImagePolicy(
            domains=domains,
            allow_private=self.allow_private_images,
            timeout_s=self.image_timeout_s,
            max_bytes=self.max_image_bytes,
            max_pixels=self.max_image_pixels,
            max_images=self.max_images,
        )

    def scheduler_config(self, *, max_context: int | None) -> SchedulerConfig:
        """The continuous scheduler's limits; `max_context` (the model's) sizes the default KV cache."""
        step_tokens = self.max_step_tokens or max(256, 2 * self.max_batch_size)
        kv_tokens = self.kv_cache_tokens or max(self.max_batch_size * KV_TOKENS_PER_SEQUENCE, max_context or 0)
        return SchedulerConfig(
            max_running=self.max_batch_size,
            max_step_tokens=step_tokens,
            kv_blocks=-(-kv_tokens // BLOCK_SIZE),
            block_size=BLOCK_SIZE,
            max_queue=self.max_queue,
        )

    @property
    def batch_policy(self) -> BatchPolicy:
        return BatchPolicy(
            max_batch_size=self.max_batch_size, max_wait_s=self.max_wait_ms / 1000, max_queue=self.max_queue
        )
