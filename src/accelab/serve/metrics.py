"""Every Prometheus metric of the server, in one place, on a registry of its own per app (so
two servers in one process, as in tests, never collide).

Latency is split the way it is spent: queue time (waiting for a batch), compute time (the
batch running), end-to-end; generation adds time to first token, time per output token and
the gap between two tokens of one sequence, and per sequence its prompt and output lengths,
the max_tokens it asked for, its prefill and decode times and why it finished. Continuous
batching adds the running and waiting sequences, the KV-cache blocks used and free,
preemptions (and the tokens they make the model compute again) and the tokens/s of the last
10 s. Retries are counted where they happen: a batch split after an error (per-batch worker,
and a continuous step run again sequence by sequence), a preempted sequence, and, on Ray, a
request retried on another replica (`FrontMetrics`).

`--metric-aliases vllm` adds vLLM's metric names (`vllm:...`, with a `model_name` label) next to
accelab's, computed from the same series at scrape time, so vLLM's own Grafana dashboards work
against accelab unchanged (`metric_aliases.VllmAliases`; deploy/README.md lists what maps to what).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401  (re-exported for the /metrics route)
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from accelab.serve import process_gauges
from accelab.serve.config import METRIC_ALIASES, MetricAliases
from accelab.serve.metric_aliases import VllmAliases

# seconds: 1 ms to 2 min, denser where interactive latencies live
LATENCY_BUCKETS = (
    *(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.35, 0.5),  # under a second
    *(0.75, 1.0, 1.5, 2.5, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0),
)
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)
FRACTION_BUCKETS = (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)
LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10_000, 20_000, 50_000, 100_000)

ERROR_KINDS = (
    "queue_full",
    "timeout",
    "too_large",
    "too_long",
    "invalid",
    "unauthorized",
    "shutting_down",
    "not_ready",
    "oom",
    "model_error",
    "client_gone",
)
RETRY_REASONS = ("oom", "batch_error")  # why a batch (or a continuous step) was split and run again
FINISH_REASONS = ("stop", "length")


class TokenRate:
    """Tokens generated per second over a sliding window (read at scrape time)."""

    WINDOW_S = 10.0

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._events: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def add(self, tokens: int) -> None:
        if tokens:
            with self._lock:
                self._events.append((self._clock(), tokens))

    def rate(self) -> float:
        now = self._clock()
        with self._lock:
            while self._events and self._events[0][0] < now - self.WINDOW_S:
                self._events.popleft()
            return sum(n for _, n in self._events) / self.WINDOW_S


class Metric:
    """One metric family, declared as a class attribute of ServeMetrics or FrontMetrics: each
    instance makes it on its own registry under that attribute's name (`make_all`). Reading it
    from an instance gives the prometheus_client metric; from the class, this declaration."""

    __slots__ = ("buckets", "help", "kind", "labels", "name")

    def __init__(
        self, kind: Any, name: str, help: str, labels: tuple[str, ...] = (), buckets: Sequence[float] | None = None
    ) -> None:
        self.kind, self.name, self.help, self.labels, self.buckets = kind, name, help, labels, buckets

    def __get__(self, obj: object, owner: type | None = None) -> Any:
        return self  # only reached from the class: an instance's own attribute (the made metric) comes first

    def make(self, registry: CollectorRegistry) -> Any:
        buckets = {} if self.buckets is None else {"buckets": self.buckets}
        return self.kind(self.name, self.help, self.labels, registry=registry, **buckets)


def make_all(owner: object, registry: CollectorRegistry) -> None:
    """Every Metric declared on `owner`'s class and the classes it declares metrics of, made on
    `registry`, in the order declared (the order /metrics lists them: the class's own first)."""
    for cls in type(owner).__mro__:
        for attribute, metric in vars(cls).items():
            if isinstance(metric, Metric):
                setattr(owner, attribute, metric.make(registry))


class ImageMetrics:
    """The metrics of a chat's images (declarations of ServeMetrics)."""

    request_images = Metric(
        Histogram, "accelab_request_images", "Images per chat request that sent any.", (), BATCH_BUCKETS
    )
    image_preprocess_time = Metric(
        Histogram,
        "accelab_image_preprocess_seconds",
        "A chat request's images fetched, decoded, processed (a VLM's continuous batching processes them on "
        "its worker's thread between two steps: the wait for that included).",
    )
    images_encoded = Metric(
        Counter, "accelab_images_encoded", "Images the vision encoder ran on (continuous batching of a VLM)."
    )
    image_cache_hits = Metric(
        Counter,
        "accelab_image_cache_hits",
        "Images whose features a sequence took from the encoder cache instead of encoding them again.",
    )
    image_encode_time = Metric(
        Counter, "accelab_image_encoder_seconds", "Time in the vision encoder (continuous batching of a VLM)."
    )


class MachineBoundMetrics:
    """Each continuous step against this machine's bound (declarations of ServeMetrics)."""

    step_fraction = Metric(
        Histogram,
        "accelab_step_machine_fraction",
        "Per continuous step: the least time this machine needs for it (its weights and KV read at the "
        "measured bandwidth, or its FLOPs at the measured peak, whichever is longer) over its wall time; "
        "1.0 is the machine's limit. Absent until `accelab env` has measured the machine.",
        (),
        FRACTION_BUCKETS,
    )
    machine_bandwidth = Metric(
        Gauge,
        "accelab_machine_read_bandwidth_bytes_per_second",
        "The read bandwidth the step fractions are against (measured by `accelab env`).",
    )
    machine_peak = Metric(
        Gauge,
        "accelab_machine_peak_flops",
        "The peak FLOP/s of the steps' precision the step fractions are against (measured by `accelab env`).",
    )


class ServeMetrics(ImageMetrics, MachineBoundMetrics):
    requests = Metric(
        Counter, "accelab_requests", "HTTP requests answered, by route and status code.", ("route", "status")
    )
    latency = Metric(
        Histogram,
        "accelab_request_latency_seconds",
        "End-to-end request latency, by route.",
        ("route",),
        LATENCY_BUCKETS,
    )
    queue_time = Metric(
        Histogram, "accelab_queue_time_seconds", "Time a request waited for its batch.", (), LATENCY_BUCKETS
    )
    compute_time = Metric(
        Histogram, "accelab_compute_time_seconds", "Run time of the batch a request was in.", (), LATENCY_BUCKETS
    )
    ttft = Metric(
        Histogram, "accelab_time_to_first_token_seconds", "Arrival to the first generated token.", (), LATENCY_BUCKETS
    )
    tpot = Metric(
        Histogram,
        "accelab_time_per_output_token_seconds",
        "Mean time per generated token after the first, per request.",
        (),
        TOKEN_BUCKETS,
    )
    prompt_tokens = Metric(Counter, "accelab_prompt_tokens", "Prompt tokens processed.")
    generated_tokens = Metric(Counter, "accelab_generated_tokens", "Completion tokens generated.")
    batch_size = Metric(
        Histogram,
        "accelab_batch_size",
        "Inputs per model call (batch size; with continuous batching, sequences per step).",
        (),
        BATCH_BUCKETS,
    )
    batch_time = Metric(Histogram, "accelab_batch_seconds", "Run time of one batch.", (), LATENCY_BUCKETS)
    batch_limit = Metric(
        Gauge, "accelab_batch_size_limit", "Largest batch the worker tries now (lowered after out-of-memory)."
    )
    queue_depth = Metric(Gauge, "accelab_queue_depth", "Requests waiting for a batch.")
    queue_limit = Metric(
        Gauge,
        "accelab_queue_limit",
        "Most requests (sequences, with continuous batching) that may wait; more get 429 (--max-queue).",
    )
    in_flight = Metric(Gauge, "accelab_requests_in_flight", "Requests being handled (queued, running or streaming).")
    errors = Metric(Counter, "accelab_errors", "Requests that failed, by kind.", ("kind",))
    retries = Metric(
        Counter,
        "accelab_batch_retries",
        "Batches split and retried, by reason (oom, batch_error); "
        "with continuous batching, steps run again sequence by sequence.",
        ("reason",),
    )
    ready = Metric(Gauge, "accelab_ready", "1 once the model is loaded and warmed up.")
    info = Metric(Gauge, "accelab_model_info", "The model and plan served (value 1).", ("model", "plan", "device"))
    running = Metric(Gauge, "accelab_running_sequences", "Sequences in the running batch (continuous batching).")
    waiting = Metric(Gauge, "accelab_waiting_sequences", "Sequences waiting to be admitted (continuous batching).")
    kv_blocks = Metric(Gauge, "accelab_kv_cache_blocks", "KV-cache blocks by state (continuous batching).", ("state",))
    kv_bytes = Metric(
        Gauge,
        "accelab_kv_cache_bytes",
        "KV-cache memory by state, in bytes (continuous batching): held by running sequences (used) or not (free).",
        ("state",),
    )
    kv_cached_blocks = Metric(
        Gauge,
        "accelab_kv_cache_prefix_blocks",
        "Free KV-cache blocks that still hold a "
        "prefix a later request may take instead of computing it (part of the free "
        "blocks; continuous batching with prefix caching).",
    )
    preemptions = Metric(
        Counter, "accelab_preemptions", "Sequences preempted to free KV-cache blocks (recomputed later)."
    )
    preempted_tokens = Metric(
        Counter,
        "accelab_preempted_tokens",
        "Tokens whose KV a preemption dropped: the model computes them again when the sequence is readmitted.",
    )
    prefix_tokens = Metric(
        Counter,
        "accelab_prefix_cache_tokens",
        "Prompt tokens whose KV came from the prefix cache instead of being computed again (continuous batching).",
    )
    itl = Metric(
        Histogram, "accelab_inter_token_latency_seconds", "Time between two tokens of one sequence.", (), TOKEN_BUCKETS
    )
    # per generated sequence (what vLLM's dashboards chart, too)
    request_prompt_tokens = Metric(
        Histogram, "accelab_request_prompt_tokens", "Prompt tokens per generated sequence.", (), LENGTH_BUCKETS
    )
    request_generation_tokens = Metric(
        Histogram, "accelab_request_generation_tokens", "Tokens generated per sequence.", (), LENGTH_BUCKETS
    )
    request_max_tokens = Metric(
        Histogram, "accelab_request_max_tokens", "max_tokens a generated sequence asked for.", (), LENGTH_BUCKETS
    )
    prefill_time = Metric(
        Histogram,
        "accelab_request_prefill_seconds",
        "Time to first token less the time in the queue, per sequence (prefill).",
        (),
        LATENCY_BUCKETS,
    )
    decode_time = Metric(
        Histogram,
        "accelab_request_decode_seconds",
        "First token to the last, per sequence (decode).",
        (),
        LATENCY_BUCKETS,
    )
    finished = Metric(
        Counter,
        "accelab_finished_sequences",
        "Generated sequences that finished, by finish reason "
        "(stop: end of sequence or a stop string; length: max_tokens).",
        ("finish_reason",),
    )
    tokens_per_second = Metric(
        Gauge,
        "accelab_generation_tokens_per_second",
        f"Tokens generated per second over the last {TokenRate.WINDOW_S:g} s.",
    )
    rss = Metric(Gauge, "accelab_process_resident_memory_bytes", "Resident memory of the server process.")

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        make_all(self, self.registry)
        self.token_rate = TokenRate()
        self.tokens_per_second.set_function(self.token_rate.rate)
        self.rss.set_function(process_gauges.rss_bytes)
        # export zeros, so a dashboard's rate() has a series from the start
        for kind in ERROR_KINDS:
            self.errors.labels(kind=kind)
        for reason in RETRY_REASONS:
            self.retries.labels(reason=reason)
        for finish in FINISH_REASONS:
            self.finished.labels(finish_reason=finish)
        self._aliases: VllmAliases | None = None
        self._gpu = process_gauges.gpu_gauges(self.registry)

    def configure(self, *, max_queue: int, model_name: str, aliases: MetricAliases = "none") -> None:
        """What the server's configuration says: the queue limit, and vLLM's names when asked for."""
        if aliases not in METRIC_ALIASES:
            raise ValueError(f"metric aliases {aliases!r} are not one of {', '.join(METRIC_ALIASES)}")
        self.queue_limit.set(max_queue)
        if aliases == "vllm" and self._aliases is None:
            self._aliases = VllmAliases(self, model_name=model_name)
            self.registry.register(self._aliases)

    def observe_generation(
        self, completions: Sequence[Any], *, arrival: float, queue_s: float, max_tokens: int
    ) -> None:
        """One answered generation request: its sequences (`Completion`s), the route's arrival
        time (time.monotonic), its time in the queue and the max_tokens it asked for."""
        for done in completions:
            self.prompt_tokens.inc(done.prompt_tokens)
            self.generated_tokens.inc(done.completion_tokens)
            self.request_prompt_tokens.observe(done.prompt_tokens)
            self.request_generation_tokens.observe(done.completion_tokens)
            self.request_max_tokens.observe(max_tokens)
            if done.finish_reason in FINISH_REASONS:
                self.finished.labels(finish_reason=done.finish_reason).inc()
            if done.first_token_at is None:
                continue
            ttft = done.first_token_at - arrival
            self.ttft.observe(ttft)
            self.prefill_time.observe(max(0.0, ttft - queue_s))
            self.decode_time.observe(max(0.0, done.finished_at - done.first_token_at))
            if done.completion_tokens > 1:
                self.tpot.observe((done.finished_at - done.first_token_at) / (done.completion_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class FrontMetrics:
    """The Ray front's own series (the replicas' come merged beside them): requests it retried
    on another replica, requests lost with a replica, and the replicas it was asked to run."""

    replica_retries = Metric(
        Counter, "accelab_replica_retries", "Requests retried on another replica because theirs died before answering."
    )
    replica_lost = Metric(
        Counter,
        "accelab_replica_lost_requests",
        "Requests answered 503 because their replica died: before answering (and again on the retry) or mid-stream.",
        ("when",),
    )
    replicas_configured = Metric(
        Gauge, "accelab_replicas_configured", "Replicas the server was started with (--replicas)."
    )

    def __init__(self, configured: int = 0):
        self.registry = CollectorRegistry()
        make_all(self, self.registry)
        for when in ("before_answer", "mid_stream"):
            self.replica_lost.labels(when=when)
        self.replicas_configured.set(configured)
