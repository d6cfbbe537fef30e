"""vLLM's metric names computed from accelab's own series at scrape time (`--metric-aliases vllm`),
so a Prometheus and Grafana set up for vLLM work when pointed at accelab; deploy/README.md lists
what maps to what."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import Metric


@dataclass(frozen=True, kw_only=True, slots=True)
class Alias:
    """vLLM's family `name` from accelab's `source` family (both without `_total`): samples keep
    their suffix (`_bucket`, `_sum`, `_count`, `_total`); `only` keeps samples whose label has one
    of the values, `drop` removes labels (samples that then coincide are summed), `rename` renames."""

    name: str
    source: str
    only: dict[str, tuple[str, ...]] = field(default_factory=dict)
    drop: tuple[str, ...] = ()
    rename: dict[str, str] = field(default_factory=dict)


VLLM_ALIASES = (
    Alias(name="vllm:num_requests_running", source="accelab_running_sequences"),
    Alias(name="vllm:num_requests_waiting", source="accelab_waiting_sequences"),
    Alias(name="vllm:prompt_tokens", source="accelab_prompt_tokens"),
    Alias(name="vllm:generation_tokens", source="accelab_generated_tokens"),
    Alias(name="vllm:num_preemptions", source="accelab_preemptions"),
    Alias(
        name="vllm:e2e_request_latency_seconds",
        source="accelab_request_latency_seconds",
        only={"route": ("chat", "completions")},
        drop=("route",),
    ),
    Alias(name="vllm:time_to_first_token_seconds", source="accelab_time_to_first_token_seconds"),
    Alias(name="vllm:inter_token_latency_seconds", source="accelab_inter_token_latency_seconds"),
    # vLLM's older name of the same per-token gap (its dashboards before v0.11 chart it)
    Alias(name="vllm:time_per_output_token_seconds", source="accelab_inter_token_latency_seconds"),
    Alias(name="vllm:request_time_per_output_token_seconds", source="accelab_time_per_output_token_seconds"),
    Alias(name="vllm:request_queue_time_seconds", source="accelab_queue_time_seconds"),
    Alias(name="vllm:request_inference_time_seconds", source="accelab_compute_time_seconds"),
    Alias(name="vllm:request_prefill_time_seconds", source="accelab_request_prefill_seconds"),
    Alias(name="vllm:request_decode_time_seconds", source="accelab_request_decode_seconds"),
    Alias(name="vllm:request_prompt_tokens", source="accelab_request_prompt_tokens"),
    Alias(name="vllm:request_generation_tokens", source="accelab_request_generation_tokens"),
    Alias(name="vllm:request_max_num_generation_tokens", source="accelab_request_max_tokens"),
    Alias(
        name="vllm:request_success", source="accelab_finished_sequences", rename={"finish_reason": "finished_reason"}
    ),
)
KV_USAGE_NAMES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # a fraction 0..1, despite "perc"


class VllmAliases:
    """A collector: vLLM's families, computed from the server's own at each scrape."""

    def __init__(self, metrics: object, *, model_name: str):  # a ServeMetrics: its families are read
        self._metrics = metrics
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        families = {family.name: family for family in self._source_families()}
        for alias in VLLM_ALIASES:
            source = families.get(alias.source)
            if source is not None:
                yield self._renamed(alias, source)
        blocks = {s.labels.get("state"): s.value for s in families["accelab_kv_cache_blocks"].samples}
        total = blocks.get("used", 0.0) + blocks.get("free", 0.0)
        for name in KV_USAGE_NAMES:
            usage = Metric(name, "KV-cache usage, a fraction of 1 (accelab_kv_cache_blocks used / all).", "gauge")
            usage.add_sample(name, {"model_name": self._model_name}, blocks.get("used", 0.0) / total if total else 0.0)
            yield usage

    def _source_families(self) -> Iterator[Metric]:
        for value in vars(self._metrics).values():
            if isinstance(value, (Counter, Gauge, Histogram)):
                yield from value.collect()

    def _renamed(self, alias: Alias, source: Metric) -> Metric:
        out = Metric(alias.name, f"{source.documentation} (accelab's {source.name})", source.type)
        summed: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for sample in source.samples:
            if sample.name.endswith("_created"):
                continue
            if any(sample.labels.get(label) not in values for label, values in alias.only.items()):
                continue
            labels = {alias.rename.get(k, k): v for k, v in sample.labels.items() if k not in alias.drop}
            labels["model_name"] = self._model_name
            key = (alias.name + sample.name[len(source.name) :], tuple(sorted(labels.items())))
            summed[key] = summed.get(key, 0.0) + sample.value
        for (name, pairs), value in summed.items():
            out.add_sample(name, dict(pairs), value)
        return out
