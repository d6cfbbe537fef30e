"""Every Prometheus metric of the server, in one place, on a registry of its own per app (so
two servers in one process, as in tests, never collide).

Latency is split the way it is spent: queue time (waiting for a batch), compute time (the
batch running), end-to-end; generation adds time to first token, time per output token and
the gap between two tokens of one sequence. Continuous batching adds the running and waiting
sequences, the KV-cache blocks used and free, preemptions and the tokens/s of the last 10 s.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401  (re-exported for the /metrics route)
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

# seconds: 1 ms to 2 min, denser where interactive latencies live
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.35, 0.5, 0.75, 1.0,
                   1.5, 2.5, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)

ERROR_KINDS = ("queue_full", "timeout", "too_large", "too_long", "invalid", "unauthorized", "shutting_down", "not_ready",
               "oom", "model_error", "client_gone")


class ServeMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("accelab_requests", "HTTP requests answered, by route and status code.",
                                ["route", "status"], registry=r)
        self.latency = Histogram("accelab_request_latency_seconds", "End-to-end request latency, by route.",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("accelab_queue_time_seconds", "Time a request waited for its batch.",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.compute_time = Histogram("accelab_compute_time_seconds", "Run time of the batch a request was in.",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("accelab_time_to_first_token_seconds", "Arrival to the first generated token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("accelab_time_per_output_token_seconds",
                              "Mean time per generated token after the first, per request.",
                              buckets=TOKEN_BUCKETS, registry=r)
        self.prompt_tokens = Counter("accelab_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generated_tokens = Counter("accelab_generated_tokens", "Completion tokens generated.", registry=r)
        self.batch_size = Histogram("accelab_batch_size", "Inputs per model call (batch size).",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.batch_time = Histogram("accelab_batch_seconds", "Run time of one batch.", buckets=LATENCY_BUCKETS,
                                    registry=r)
        self.batch_limit = Gauge("accelab_batch_size_limit", "Largest batch the worker tries now "
                                 "(lowered after out-of-memory).", registry=r)
        self.queue_depth = Gauge("accelab_queue_depth", "Requests waiting for a batch.", registry=r)
        self.in_flight = Gauge("accelab_requests_in_flight", "Requests being handled (queued, running or "
                               "streaming).", registry=r)
        self.errors = Counter("accelab_errors", "Requests that failed, by kind.", ["kind"], registry=r)
        self.retries = Counter("accelab_batch_retries", "Batches split and retried, by reason (oom, batch_error).",
                               ["reason"], registry=r)
        self.ready = Gauge("accelab_ready", "1 once the model is loaded and warmed up.", registry=r)
        self.info = Gauge("accelab_model_info", "The model and plan served (value 1).", ["model", "plan", "device"],
                          registry=r)
        self.running = Gauge("accelab_running_sequences", "Sequences in the running batch (continuous batching).",
                             registry=r)
        self.waiting = Gauge("accelab_waiting_sequences", "Sequences waiting to be admitted (continuous batching).",
                             registry=r)
        self.kv_blocks = Gauge("accelab_kv_cache_blocks", "KV-cache blocks by state (continuous batching).",
                               ["state"], registry=r)
        self.preemptions = Counter("accelab_preemptions", "Sequences preempted to free KV-cache blocks (recomputed "
                                   "later).", registry=r)
        self.prefix_tokens = Counter("accelab_prefix_cache_tokens", "Prompt tokens whose KV came from the prefix "
                                     "cache instead of being computed again (continuous batching).", registry=r)
        self.itl = Histogram("accelab_inter_token_latency_seconds", "Time between two tokens of one sequence.",
                             buckets=TOKEN_BUCKETS, registry=r)
        self.token_rate = TokenRate()
        self.tokens_per_second = Gauge("accelab_generation_tokens_per_second",
                                       f"Tokens generated per second over the last {TokenRate.WINDOW_S:g} s.", registry=r)
        self.tokens_per_second.set_function(self.token_rate.rate)
        self.rss = Gauge("accelab_process_resident_memory_bytes", "Resident memory of the server process.",
                         registry=r)
        self.rss.set_function(_rss_bytes)
        for kind in ERROR_KINDS:  # export zeros, so a dashboard's rate() has a series from the start
            self.errors.labels(kind=kind)
        for reason in ("oom", "batch_error"):
            self.retries.labels(reason=reason)
        self._gpu = _gpu_gauges(r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class TokenRate:
    """Tokens generated per second over a sliding window (read at scrape time)."""

    WINDOW_S = 10.0

    def __init__(self, clock=time.monotonic):
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


def _rss_bytes() -> float:
    try:
        import psutil

        return float(psutil.Process(os.getpid()).memory_info().rss)
    except Exception:  # noqa: BLE001 - a scrape must not fail over one gauge
        return float("nan")


def _gpu_gauges(registry: CollectorRegistry) -> Gauge | None:
    """GPU memory, per device, only where torch sees a CUDA GPU."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        return None
    if not torch.cuda.is_available():
        return None
    allocated = Gauge("accelab_gpu_memory_allocated_bytes", "torch.cuda.memory_allocated per device.", ["device"],
                      registry=registry)
    reserved = Gauge("accelab_gpu_memory_reserved_bytes", "torch.cuda.memory_reserved per device.", ["device"],
                     registry=registry)
    peak = Gauge("accelab_gpu_memory_peak_bytes", "torch.cuda.max_memory_allocated per device.", ["device"],
                 registry=registry)
    for index in range(torch.cuda.device_count()):
        allocated.labels(device=str(index)).set_function(lambda i=index: torch.cuda.memory_allocated(i))
        reserved.labels(device=str(index)).set_function(lambda i=index: torch.cuda.memory_reserved(i))
        peak.labels(device=str(index)).set_function(lambda i=index: torch.cuda.max_memory_allocated(i))
    return allocated
