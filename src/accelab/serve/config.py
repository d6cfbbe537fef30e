"""ServeConfig: how the server admits, batches and limits requests; ServeRun: what `accelab serve`
serves and how it runs it. No I/O here. Each field `accelab serve` sets declares its option
(`accelab.options.option`); the command line is made from them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from accelab.options import fields_of, option
from accelab.serve.batcher import BatchPolicy

if TYPE_CHECKING:
    from accelab.serve.images import ImagePolicy
    from accelab.serve.scheduler import SchedulerConfig

Scheduling = Literal["continuous", "static"]
SCHEDULINGS: tuple[Scheduling, ...] = ("continuous", "static")
MetricAliases = Literal["none", "vllm"]
METRIC_ALIASES: tuple[MetricAliases, ...] = ("none", "vllm")
KV_TOKENS_PER_SEQUENCE = 2048  # the default KV cache: this many tokens for each running sequence
BLOCK_SIZE = 16  # tokens per KV-cache block
MIB = 1024 * 1024


@dataclass(frozen=True, kw_only=True, slots=True)
class ServeRun:
    """What `accelab serve MODEL` serves, and how it runs it (one server, or replicas on Ray)."""

    task: str | None = field(default=None, metadata=option("Override the task inferred from the model's config."))
    plan: str = field(
        default="baseline",
        metadata=option(
            "A preset name (baseline, compile, int8-weight, ...) or a YAML plan file (e.g. from `accelab tune`).",
            "--plan",
        ),
    )
    overrides: list[str] = field(
        default_factory=list, metadata=option("Override a plan field: --set threads=2 (repeatable).", "--set")
    )
    device: str | None = field(default=None, metadata=option("cpu | cuda | cuda:N (default: CUDA when present)."))
    served_name: str | None = field(
        default=None, metadata=option("Model id in /v1/models and requests (default: MODEL).", "--served-name")
    )
    access_log: bool = field(default=False, metadata=option("Log every request.", "--access-log"))
    replicas: int = field(
        default=1,
        metadata=option(
            "Serve N copies of the model on Ray Serve behind one address "
            "(needs accelab[ray]); with --ray-address, across a Ray cluster's machines.",
            "--replicas",
        ),
    )
    ray_address: str | None = field(
        default=None,
        metadata=option(
            "Join this Ray cluster (HOST:6379, or 'auto') instead of starting a local Ray instance.", "--ray-address"
        ),
    )

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"--replicas {self.replicas} must be 1 or more")


@dataclass(frozen=True, kw_only=True, slots=True)
class ServeConfig:
    model_name: str  # the id /v1/models lists and requests name
    plan_name: str = "baseline"
    host: str = field(
        default="127.0.0.1",
        metadata=option(
            "Address to listen on. Anything but 127.0.0.1 exposes the server to the network: give it an --api-key."
        ),
    )
    port: int = field(default=8000, metadata=option("Port to listen on (0: any free port, printed at start)."))
    # inputs per model call; with continuous batching, sequences decoding at once
    max_batch_size: int = field(
        default=32,
        metadata=option(
            "Most inputs per model call; for generation with continuous batching, the most sequences decoding at once.",
            "--max-batch-size",
        ),
    )
    # generation: "continuous" schedules every decoding step (requests join and leave the running
    # batch); "static" runs one generate call per batch (vision-language models always do)
    scheduler: Scheduling = field(
        default="continuous",
        metadata=option(
            "Generation: continuous (requests join and "
            "leave the running batch at every decoding step) or static (one generate call "
            "per batch).",
            "--scheduler",
        ),
    )
    # tokens per step (decodes + prefill chunks); None: max(256, 2 x batch)
    max_step_tokens: int | None = field(
        default=None,
        metadata=option(
            "Continuous batching: tokens "
            "per decoding step; long prompts are prefilled in chunks of what "
            "the running decodes leave (default: max(256, 2 x batch size)).",
            "--max-step-tokens",
        ),
    )
    # 1: at 8 users and half the requests with a new image, text TTFT p99 0.72 s against 1.22 s at 4
    # (benchmarks/results/serve_vlm_step_images.txt), tokens/s 1.05-1.08x
    max_step_images: int = field(
        default=1,
        metadata=option(
            "Continuous batching of a vision-language model: images whose encoding one step may start; a "
            "prefill chunk ends before the next one, so image-heavy prompts never stall the running "
            "decodes for long (0: no cap).",
            "--max-step-images",
        ),
    )
    encoder_share: float = field(
        default=1.0,
        metadata=option(
            "Continuous batching of a vision-language model: how long the vision encoder runs after each "
            "step, as a multiple of that step's time (images are encoded between the steps, layer by layer; "
            "more: images start sooner, the running decodes slow down).",
            "--encoder-share",
        ),
    )
    encoder_batch: int = field(
        default=2,
        metadata=option(
            "Continuous batching of a vision-language model: images the vision encoder takes in one "
            "forward, at most, from those the waiting prompts hold (more rows per GEMM run faster per "
            "image on a CPU; the first image of a batch is ready later).",
            "--encoder-batch",
        ),
    )
    # KV-cache capacity; None: 2048 per sequence, within the memory left after the weights
    kv_cache_tokens: int | None = field(
        default=None,
        metadata=option(
            "Continuous batching: KV-cache "
            "capacity in tokens, over all sequences; requests queue when it "
            "is full, and one that needs more than all of it is refused (default: 2048 per sequence "
            "of --max-batch-size, within half the memory left after the weights).",
            "--kv-cache-tokens",
        ),
    )
    max_wait_ms: float = field(
        default=5.0,
        metadata=option("How long the first request of a batch waits for others (ms).", "--max-wait-ms"),
    )
    max_queue: int = field(
        default=256, metadata=option("Requests that may wait; more get 429 with Retry-After.", "--max-queue")
    )
    request_timeout_s: float = field(
        default=60.0,
        metadata=option("A request not started after this many seconds gets 504 and is not run.", "--request-timeout"),
    )
    grace_period_s: float = field(
        default=30.0,
        metadata=option("On SIGTERM, seconds to finish requests in flight before exiting.", "--grace-period"),
    )
    max_body_bytes: int = field(default=20 * MIB, metadata=option("Larger request bodies get 413.", "--max-body-bytes"))
    max_tokens: int = field(
        default=2048, metadata=option("Largest max_tokens a request may ask for (413 above).", "--max-tokens")
    )
    # chat completions without max_tokens (capped by max_tokens)
    default_max_tokens: int = field(
        default=256, metadata=option("max_tokens of chat requests that give none.", "--default-max-tokens")
    )
    max_inputs: int = field(
        default=256, metadata=option("Most texts, prompts or images per request (413 above).", "--max-inputs")
    )
    # images in requests (accelab.serve.images): http(s) URLs are fetched from these domains (empty:
    # any public host), never from private or loopback addresses unless allowed
    image_domains: str = field(
        default="",
        metadata=option(
            "Comma-separated domains whose http(s) image URLs are fetched (and their subdomains); "
            "empty: any public host.",
            "--image-domains",
        ),
    )
    allow_private_images: bool = field(
        default=False,
        metadata=option(
            "Also fetch image URLs on private, loopback and link-local addresses.", "--allow-private-images"
        ),
    )
    image_timeout_s: float = field(
        default=10.0, metadata=option("Seconds an image URL may take (400 after).", "--image-timeout")
    )
    max_image_bytes: int = field(
        default=20 * MIB, metadata=option("Largest image a URL may return (413 above).", "--max-image-bytes")
    )
    max_image_pixels: int = field(
        default=40_000_000, metadata=option("Most pixels per image (413 above).", "--max-image-pixels")
    )
    max_images: int = field(
        default=8, metadata=option("Most images in one generation request (413 above).", "--max-images")
    )
    # when set, API routes need "Authorization: Bearer <key>"
    api_key: str | None = field(
        default=None,
        metadata=option(
            "Require 'Authorization: Bearer KEY' on the API routes.", "--api-key", envvar="ACCELAB_API_KEY"
        ),
    )
    # "vllm": /metrics also carries vLLM's names (for its dashboards)
    metric_aliases: MetricAliases = field(
        default="none",
        metadata=option(
            "vllm: /metrics also exports vLLM's "
            "metric names (vllm:..., with model_name), so vLLM's Grafana dashboards work "
            "unchanged (see deploy/README.md).",
            "--metric-aliases",
        ),
    )

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
            "encoder_batch",
        )
        for name in positive:
            value = getattr(self, name)
            if value < 1 and not (name == "port" and value == 0):
                raise ValueError(f"{name}={value} must be 1 or more")
        if not self.encoder_share > 0:
            raise ValueError(f"encoder_share={self.encoder_share} must be more than 0")
        for name in ("max_wait_ms", "request_timeout_s", "grace_period_s", "image_timeout_s", "max_step_images"):
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
        self.scheduler_config()  # its own checks (e.g. step tokens > batch size), now

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
        return cls(model_name=model_name, plan_name=plan_name, **fields_of(cls, merged))

    def image_policy(self) -> ImagePolicy:
        from accelab.serve.images import ImagePolicy

        domains = tuple(d.strip().lower().lstrip(".") for d in self.image_domains.split(",") if d.strip())
        return ImagePolicy(
            domains=domains,
            allow_private=self.allow_private_images,
            timeout_s=self.image_timeout_s,
            max_bytes=self.max_image_bytes,
            max_pixels=self.max_image_pixels,
            max_images=self.max_images,
        )

    def scheduler_config(self, *, room_tokens: int | None = None) -> SchedulerConfig:
        """The continuous scheduler's limits. The KV cache: --kv-cache-tokens, else 2048 tokens for
        each of --max-batch-size sequences, but no more than `room_tokens` (what half the memory
        left after the weights holds), and at least a block; never the model's whole context (131,072
        tokens of an 8B Llama's keys and values are 16 GiB in bf16): a request longer than the
        cache is refused with the reason, one that fits waits for room."""
        from accelab.serve.scheduler import SchedulerConfig

        step_tokens = self.max_step_tokens or max(256, 2 * self.max_batch_size)
        kv_tokens = self.default_kv_tokens
        if self.kv_cache_tokens is None and room_tokens is not None:
            kv_tokens = max(BLOCK_SIZE, min(kv_tokens, room_tokens))
        return SchedulerConfig(
            max_running=self.max_batch_size,
            max_step_tokens=step_tokens,
            kv_blocks=-(-kv_tokens // BLOCK_SIZE),
            block_size=BLOCK_SIZE,
            max_queue=self.max_queue,
            max_step_images=self.max_step_images,
        )

    @property
    def default_kv_tokens(self) -> int:
        """The KV cache this config asks for before memory has its say."""
        return self.kv_cache_tokens or self.max_batch_size * KV_TOKENS_PER_SEQUENCE

    @property
    def batch_policy(self) -> BatchPolicy:
        return BatchPolicy(
            max_batch_size=self.max_batch_size, max_wait_s=self.max_wait_ms / 1000, max_queue=self.max_queue
        )
