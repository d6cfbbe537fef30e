"""What a Result measured, read the same way whatever its kind. Pure: no I/O, no plotting.

Each kind's metrics are read by exactly the keys its producer writes, as
`accelab.results.contract` names them; every report, history row and regression check reads them
through these functions, so a missing field is `None` here and never a KeyError three modules away.
"""

from __future__ import annotations

import math
from typing import Any, TypeGuard, TypeVar

from accelab.results import contract as K
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


T = TypeVar("T")


def known(value: T | None) -> T:
    """A figure the caller made sure is there (it kept only the results that have it)."""
    assert value is not None, "a figure the results were filtered on is missing"
    return value


def is_stats(value: Any) -> TypeGuard[dict[str, Any]]:
    return isinstance(value, dict) and number(value.get("p50")) is not None


def is_generate(result: Result) -> bool:
    return result.workload.get("scenario") == "generate"


def latency_key(result: Result) -> str:
    """The per-request latency: one forward call, one generate call, one load-test request."""
    return K.E2E_MS if is_generate(result) or result.kind == "loadtest" else K.LATENCY_MS


def latency_stats(result: Result) -> dict[str, float] | None:
    stats = result.metrics.get(latency_key(result))
    return stats if is_stats(stats) else None


def latency_samples(result: Result) -> list[float] | None:
    """Raw per-call latencies (ms) when the run stored them."""
    samples = result.metrics.get(K.LATENCY_SAMPLES_MS)
    if not isinstance(samples, list):
        return None
    values = [v for v in (number(s) for s in samples) if v is not None]
    return values or None


def stat(result: Result, name: str) -> float | None:
    stats = latency_stats(result)
    return number(stats.get(name)) if stats else None


# Where each kind keeps its rate and that rate's unit; bench, compare and tune name their unit.
_RATES = {"train": K.TRAIN.key(K.SAMPLES_PER_S), "loadtest": K.LOADTEST.key(K.REQUEST_THROUGHPUT)}


def throughput(result: Result) -> float | None:
    rate = _RATES.get(result.kind)
    return number(result.metrics.get(rate.name if rate else K.THROUGHPUT))


def throughput_unit(result: Result) -> str:
    rate = _RATES.get(result.kind)
    if rate:
        return rate.unit
    # a run that measured nothing names no unit: the scenario's
    return str(result.metrics.get(K.THROUGHPUT_UNIT) or ("tokens/s" if is_generate(result) else "items/s"))


# Processes of a launch (train; predict writes the same keys): the GPU peak, else the largest RSS.
_PROCESS_PEAKS = (K.GPU_PEAK_ALLOCATED_MB_MAX, K.PEAK_RSS_MB_MAX)


def peak_memory_mb(result: Result) -> float | None:
    if result.kind not in ("train", "predict"):
        return number(result.metrics.get(K.PEAK_MEMORY_MB))
    return next((number(result.metrics[k]) for k in _PROCESS_PEAKS if number(result.metrics.get(k)) is not None), None)


def epoch_seconds(result: Result) -> float | None:
    """Training time of one epoch."""
    return number(result.metrics.get(K.EPOCH_S))


def quality_verdict(result: Result) -> str | None:
    return (result.quality or {}).get("verdict")


def model_name(result: Result) -> str:
    return str(result.model.get("name") or "?")


def plan_name(result: Result) -> str:
    return str(result.plan.get("name") or "-")


def batch_size(result: Result) -> int | None:
    wl = result.workload
    value = wl.get("batch_size") or result.plan.get("batch_size") or wl.get("global_batch")
    return int(n) if (n := number(value)) is not None else None


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
    if number(m.get(K.FINAL_ACCURACY)) is not None:
        parts.append(f"accuracy {m[K.FINAL_ACCURACY]:.1%}")
    if number(m.get(K.MAX_RATE)) is not None:
        parts.append(f"max {fmt(m[K.MAX_RATE])} req/s under SLO")
    if quality_verdict(result):
        parts.append(f"quality {quality_verdict(result)}")
    return " · ".join(parts) or "-"
