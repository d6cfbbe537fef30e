"""What a Result measured, read the same way whatever its kind. Pure: no I/O, no plotting.

Kinds store different metric shapes (see `accelab.results.result`); every report, history row
and regression check reads them through these functions, so a missing field is `None` here and
never a KeyError three modules away.
"""

from __future__ import annotations

import math
from typing import Any

from accelab.results.result import Result
from accelab.results.table import fmt

# Workload fields that decide whether two runs did the same work (measurement settings such as
# min_iters / min_seconds / warmup are left out: they change the precision, not the work).
WORKLOAD_SHAPE = ("scenario", "batch_size", "seq_len", "new_tokens", "image_size", "inputs")


def number(value: Any) -> float | None:
    """A finite float, or None (bools, strings, NaN and missing values are not measurements)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def is_stats(value: Any) -> bool:
    return isinstance(value, dict) and number(value.get("p50")) is not None


def is_generate(result: Result) -> bool:
    return result.workload.get("scenario") == "generate"


def latency_stats(result: Result) -> dict[str, float] | None:
    """The per-request latency distribution: `latency_ms` for a forward, `e2e_ms` for generation."""
    metrics = result.metrics
    first = ("e2e_ms", "latency_ms") if is_generate(result) else ("latency_ms", "e2e_ms")
    for key in first:
        if is_stats(metrics.get(key)):
            return metrics[key]
    return None


def latency_samples(result: Result) -> list[float] | None:
    """Raw per-call latencies (ms) when the run stored them (`metrics.latency_samples_ms`)."""
    samples = result.metrics.get("latency_samples_ms")
    if not isinstance(samples, list):
        return None
    values = [v for v in (number(s) for s in samples) if v is not None]
    return values or None


def stat(result: Result, name: str) -> float | None:
    stats = latency_stats(result)
    return number(stats.get(name)) if stats else None


# Where each kind keeps its rate, and its unit when the Result does not name one.
THROUGHPUT_KEYS = (("throughput", None), ("samples_per_s", "samples/s"), ("request_throughput", "req/s"))


def _throughput_key(result: Result) -> tuple[str, str | None] | None:
    return next(((k, u) for k, u in THROUGHPUT_KEYS if number(result.metrics.get(k)) is not None), None)


def throughput(result: Result) -> float | None:
    found = _throughput_key(result)
    return number(result.metrics[found[0]]) if found else None


def throughput_unit(result: Result) -> str:
    if result.metrics.get("throughput_unit"):
        return str(result.metrics["throughput_unit"])
    found = _throughput_key(result)
    if found and found[1]:
        return found[1]
    return "tokens/s" if is_generate(result) else "items/s"


# bench / tune / compare store peak_memory_mb; train stores the GPU peak or the largest rank's RSS.
MEMORY_KEYS = ("peak_memory_mb", "gpu_peak_allocated_mb_max", "peak_rss_mb_max")


def peak_memory_mb(result: Result) -> float | None:
    return next((number(result.metrics[k]) for k in MEMORY_KEYS if number(result.metrics.get(k)) is not None), None)


def epoch_seconds(result: Result) -> float | None:
    """Training time of one epoch (`accelab train`: epoch_s)."""
    m = result.metrics
    return number(m.get("epoch_s")) if number(m.get("epoch_s")) is not None else number(m.get("epoch_time_s"))


def quality_verdict(result: Result) -> str | None:
    return (result.quality or {}).get("verdict")


def model_name(result: Result) -> str:
    return str(result.model.get("name") or "?")


def plan_name(result: Result) -> str:
    return str(result.plan.get("name") or "-")


def batch_size(result: Result) -> int | None:
    wl = result.workload
    value = wl.get("batch_size") or result.plan.get("batch_size") or wl.get("global_batch")
    return int(value) if number(value) is not None else None


def workload_key(result: Result) -> tuple[Any, ...]:
    return tuple(result.workload.get(name) for name in WORKLOAD_SHAPE)


def workload_label(result: Result) -> str:
    wl = result.workload
    if not wl:
        return "-"
    parts = [str(wl.get("scenario") or result.kind)]
    if wl.get("batch_size") is not None:
        parts.append(f"batch {wl['batch_size']}")
    elif wl.get("global_batch") is not None:  # train: samples per optimizer step, all processes
        parts.append(f"global batch {wl['global_batch']}")
    if (wl.get("nproc") or 1) > 1 or (wl.get("nnodes") or 1) > 1:
        parts.append(f"{wl.get('nproc')} processes x {wl.get('nnodes') or 1} nodes")
    task = result.model.get("task")
    if wl.get("scenario") == "generate" and wl.get("new_tokens"):
        parts.append(f"{wl['new_tokens']} new tokens")
    elif task in ("feature-extraction", "text-generation") and wl.get("seq_len"):
        parts.append(f"seq {wl['seq_len']}")
    if wl.get("image_size"):
        parts.append(f"{wl['image_size']}px")
    return " · ".join(parts)


def first_line(text: str | None, width: int = 100) -> str:
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return line if len(line) <= width else line[: width - 1] + "…"


def key_metric(result: Result) -> str:
    """The one figure a person looks for in a list of runs."""
    if not result.ok:
        return f"{result.status}: {first_line(result.reason, 60)}" if result.reason else result.status
    m = result.metrics
    parts = []
    p50 = stat(result, "p50")
    if p50 is not None:
        parts.append(f"{'e2e ' if is_generate(result) else ''}p50 {fmt(p50)} ms")
    if throughput(result) is not None:
        parts.append(f"{fmt(throughput(result))} {throughput_unit(result)}")
    if epoch_seconds(result) is not None:
        parts.append(f"epoch {fmt(epoch_seconds(result))} s")
    if number(m.get("final_accuracy")) is not None:
        parts.append(f"accuracy {m['final_accuracy']:.1%}")
    if number(m.get("max_rate")) is not None:
        parts.append(f"max {fmt(m['max_rate'])} req/s under SLO")
    if quality_verdict(result):
        parts.append(f"quality {quality_verdict(result)}")
    return " · ".join(parts) or "-"
