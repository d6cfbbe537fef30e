"""What the regression gate checks for a run of each kind, and where each figure and its noise
come from: a MetricSpec per metric, most important first. A latency percentile is judged
against the coefficient of variation of its distribution (a p99 against its tail width,
(p99 - p50) / p50); throughput against the cv of the main latencies; a training run against the
cv of its step times; peak memory has no spread (the `regress` docstring gives the rule). Pure."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from accelab.report import metrics as M
from accelab.results import contract as K
from accelab.results.result import Result

Better = Literal["lower", "higher"]
Family = Literal["latency", "throughput", "memory"]
Stats = Callable[[Result], dict[str, Any] | None]


@dataclass(frozen=True, kw_only=True, slots=True)
class MetricSpec:
    label: str
    unit: str
    better: Better
    family: Family
    read: Callable[[Result], float | None]
    spread: Callable[[Result], float | None] = field(default=lambda r: None)
    spread_name: str = ""


def _stats_of(key: str | None) -> Stats:
    """The stats dict `metrics[key]`, or the main latency distribution when key is None."""

    def get(result: Result) -> dict[str, Any] | None:
        value = M.latency_stats(result) if key is None else result.metrics.get(key)
        return value if M.is_stats(value) else None

    return get


def _field(stats: Stats, name: str) -> Callable[[Result], float | None]:
    return lambda r: M.number((stats(r) or {}).get(name))


def _cv(stats: Stats) -> Callable[[Result], float | None]:
    return _field(stats, "cv")


def _tail(stats: Stats) -> Callable[[Result], float | None]:
    def width(result: Result) -> float | None:
        s = stats(result) or {}
        p50, p99 = M.number(s.get("p50")), M.number(s.get("p99"))
        return (p99 - p50) / p50 if p50 and p99 is not None else None

    return width


def _percentile(label: str, stats: Stats, name: str = "p50") -> MetricSpec:
    """A latency percentile of `stats`: a p99 against its tail width, any other against the cv."""
    tail = name == "p99"
    return MetricSpec(
        label=label,
        unit="ms",
        better="lower",
        family="latency",
        read=_field(stats, name),
        spread=_tail(stats) if tail else _cv(stats),
        spread_name="tail" if tail else "cv",
    )


def _rate(label: str, unit: str, noise: Stats) -> MetricSpec:
    return MetricSpec(
        label=label,
        unit=unit,
        better="higher",
        family="throughput",
        read=M.throughput,
        spread=_cv(noise),
        spread_name="cv",
    )


PEAK_MEMORY = MetricSpec(label="peak memory", unit="MB", better="lower", family="memory", read=M.peak_memory_mb)


def _train_specs() -> list[MetricSpec]:
    steps = _stats_of(K.STEP_MS)  # the step time distribution is the noise of a training run
    epoch = MetricSpec(
        label="epoch time",
        unit="s",
        better="lower",
        family="latency",
        read=M.epoch_seconds,
        spread=_cv(steps),
        spread_name="cv",
    )
    return [_percentile("step p50", steps), _rate("samples/s", "samples/s", steps), epoch, PEAK_MEMORY]


def metric_specs(result: Result) -> list[MetricSpec]:
    """What is checked for a run of this kind and scenario, most important first."""
    if result.kind == "train":
        return _train_specs()
    main = _stats_of(None)
    prefix = "e2e " if M.is_generate(result) else ""
    specs = [_percentile(f"{prefix}p50", main), _percentile(f"{prefix}p99", main, "p99")]
    if M.is_generate(result):
        specs += [_percentile("TTFT p50", _stats_of(K.TTFT_MS)), _percentile("TPOT p50", _stats_of(K.TPOT_MS))]
    return [*specs, _rate("throughput", M.throughput_unit(result), main), PEAK_MEMORY]
