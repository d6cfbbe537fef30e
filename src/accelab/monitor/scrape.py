"""One scrape of /metrics as numbers, and what two scrapes say together (pure: no I/O, no clock).

A `Snapshot` holds every sample of one scrape. Sums run over every label not asked for, so a
`--replicas N` server (series labelled by `replica`) reads as one server. `Window` is the
difference of two snapshots: rates, and latency percentiles of the observations between them,
interpolated inside histogram buckets exactly as Prometheus' `histogram_quantile` does, so
`accelab top` and a dashboard over the same data show the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]
NOT_API = ("models", "other")  # routes that are not API requests: /v1/models, unknown paths


@dataclass(frozen=True, kw_only=True, slots=True)
class Snapshot:
    at: float  # when it was scraped (seconds, any monotonic clock)
    samples: dict[tuple[str, Labels], float]

    @classmethod
    def parse(cls, text: str, *, at: float) -> Snapshot:
        samples: dict[tuple[str, Labels], float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return cls(at=at, samples=samples)

    def has(self, name: str) -> bool:
        return any(key[0] == name for key in self.samples)

    def series(self, name: str) -> list[tuple[dict[str, str], float]]:
        return [(dict(labels), value) for (n, labels), value in self.samples.items() if n == name]

    def total(self, name: str, *, exclude: dict[str, tuple[str, ...]] | None = None, **match: str) -> float:
        """The sum of `name` over every series whose labels match (and whose `exclude` labels do not)."""
        total = 0.0
        for labels, value in self.series(name):
            if (
                all(labels.get(k) == v for k, v in match.items())
                and not any(labels.get(k) in values for k, values in (exclude or {}).items())
                and not math.isnan(value)
            ):
                total += value
        return total

    def by(self, name: str, label: str, **match: str) -> dict[str, float]:
        """`name` summed per value of `label`."""
        out: dict[str, float] = {}
        for labels, value in self.series(name):
            if label in labels and all(labels.get(k) == v for k, v in match.items()):
                out[labels[label]] = out.get(labels[label], 0.0) + value
        return out

    def buckets(self, name: str, *, exclude: dict[str, tuple[str, ...]] | None = None) -> list[tuple[float, float]]:
        """A histogram's cumulative buckets [(upper bound, count)], summed over its other labels."""
        counts: dict[float, float] = {}
        for labels, value in self.series(f"{name}_bucket"):
            if any(labels.get(k) in values for k, values in (exclude or {}).items()):
                continue
            le = float(labels["le"])
            counts[le] = counts.get(le, 0.0) + value
        return sorted(counts.items())


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over cumulative `buckets` (the last one +Inf); None when
    they hold no observation."""
    if len(buckets) < 2 or not math.isinf(buckets[-1][0]):
        return None
    bounds = [le for le, _ in buckets]
    counts = [c for _, c in buckets]
    for i in range(1, len(counts)):  # scrapes are not atomic: a bucket may lag the one below it
        counts[i] = max(counts[i], counts[i - 1])
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    b = next((i for i, c in enumerate(counts[:-1]) if c >= rank), len(counts) - 1)
    if b == len(counts) - 1:  # in the +Inf bucket: the largest finite bound is all that is known
        return bounds[-2]
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start = 0.0 if b == 0 else bounds[b - 1]
    below = 0.0 if b == 0 else counts[b - 1]
    inside = counts[b] - below
    return start + (bounds[b] - start) * (rank - below) / inside


def _delta(new: list[tuple[float, float]], old: list[tuple[float, float]]) -> list[tuple[float, float]]:
    before = dict(old)
    deltas = [(le, count - before.get(le, 0.0)) for le, count in new]
    if any(d < 0 for _, d in deltas):  # a counter reset (the server restarted): only the new counts count
        return new
    return deltas


@dataclass(frozen=True, kw_only=True, slots=True)
class Window:
    """What happened between two snapshots of one server."""

    old: Snapshot
    new: Snapshot

    @property
    def seconds(self) -> float:
        return self.new.at - self.old.at

    def increase(self, name: str, **kw) -> float:
        new, old = self.new.total(name, **kw), self.old.total(name, **kw)
        return new - old if new >= old else new  # a reset: the server restarted

    def rate(self, name: str, **kw) -> float | None:
        return self.increase(name, **kw) / self.seconds if self.seconds > 0 else None

    def increase_by(self, name: str, label: str) -> dict[str, float]:
        new, old = self.new.by(name, label), self.old.by(name, label)
        return {k: v - old.get(k, 0.0) if v >= old.get(k, 0.0) else v for k, v in new.items()}

    def quantile(self, q: float, name: str, **kw) -> float | None:
        return quantile(q, _delta(self.new.buckets(name, **kw), self.old.buckets(name, **kw)))


def api_requests(snapshot: Snapshot) -> float:
    return snapshot.total("accelab_requests_total", exclude={"route": NOT_API})


def top_kinds(counts: dict[str, float], limit: int = 2) -> Iterable[tuple[str, float]]:
    """The `limit` largest non-zero counts, largest first."""
    return sorted(((k, v) for k, v in counts.items() if v > 0), key=lambda kv: (-kv[1], kv[0]))[:limit]
