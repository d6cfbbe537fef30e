"""The tuner's `measure`: one bench child per candidate, stored, and replayed on resume. Its
Results carry the bench keys and the tuner's own (`accelab.results.contract.TUNE_FORWARD`,
`TUNE_GENERATE`)."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace

from rich.console import Console

from accelab.benchmark.engine import bench
from accelab.benchmark.rounds import measure_plans
from accelab.catalog.spec import ModelSpec
from accelab.plan.presets import PRESETS
from accelab.quality.collect import QualityConfig
from accelab.quality.verdict import label
from accelab.results import contract as K
from accelab.results.result import Result
from accelab.results.store import Store
from accelab.scenarios.workload import Workload
from accelab.tuner.search import Candidate, Measurement, Phase

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class BenchMeasurer:
    spec: ModelSpec
    workload: Workload
    device: str | None
    store: Store | None
    group_id: str
    quality: QualityConfig | None
    tolerance: str
    screen_seconds: float = 1.0
    final_seconds: float = 3.0
    timeout_s: float = 1800.0
    console: Console = field(default_factory=lambda: Console(stderr=True))
    replay: dict[tuple[str, str], list[Result]] = field(default_factory=dict)
    results: list[Result] = field(default_factory=list)
    _quality_by_variant: dict[str, str | None] = field(default_factory=dict)
    reused: int = 0

    def load_replay(self) -> int:
        """Earlier measurements of this same tune (same group id), to resume an interrupted run."""
        if self.store is None:
            return 0
        stored = sorted(
            self.store.query(group_id=self.group_id, kind="tune"), key=lambda r: r.metrics.get(K.TUNE_SEQ, 0)
        )
        queues: dict[tuple[str, str], list[Result]] = defaultdict(list)
        for r in stored:
            queues[(r.metrics.get(K.TUNE_CANDIDATE, ""), r.metrics.get(K.TUNE_PHASE, ""))].append(r)
        self.replay = dict(queues)
        return len(stored)

    def __call__(self, candidate: Candidate, phase: Phase) -> Measurement:
        queue = self.replay.get((candidate.key, phase))
        if queue:
            self.reused += 1
            result = queue.pop(0)
            self.results.append(result)
            self._quality_by_variant.setdefault(candidate.variant, result.metrics.get(K.TUNE_QUALITY))
            return self._to_measurement(result, candidate, phase, seconds=0.0)
        plan = PRESETS[candidate.variant].with_changes(batch_size=candidate.batch_size)
        seconds = self.screen_seconds if phase in ("screen", "grow") else self.final_seconds
        workload = replace(
            self.workload,
            batch_size=candidate.batch_size,
            min_seconds=seconds,
            min_iters=3 if phase in ("screen", "grow") else max(self.workload.min_iters, 5),
            warmup=1 if phase in ("screen", "grow") else self.workload.warmup,
        )
        # quality depends on the technique, not the batch: check each variant once
        check_quality = self.quality is not None and candidate.variant not in self._quality_by_variant
        self.console.print(f"[dim]  {phase:8s} {candidate.key} ...[/]", end="")
        t0 = time.perf_counter()
        result = bench(
            self.spec,
            plan,
            workload,
            device=self.device,
            timeout_s=self.timeout_s,
            kind="tune",
            group_id=self.group_id,
            quality=self.quality if check_quality else None,
            tolerance=self.tolerance,
        )
        cost = time.perf_counter() - t0
        if check_quality and result.ok:
            self._quality_by_variant[candidate.variant] = label(result.quality)
        m = self._keep(result, candidate, phase, cost)
        summary = (
            f"{m.throughput:.4g} {result.metrics.get(K.THROUGHPUT_UNIT, '')}"
            if m.throughput
            else (m.reason or m.status)
        )
        self.console.print(f"[dim] {summary[:100]} ({cost:.0f} s)[/]")
        return m

    def together(self, candidates: list[Candidate], phase: Phase) -> list[Measurement]:
        """The final: candidates side by side in alternating rounds (accelab.benchmark.rounds), each
        in its own warm child, so the search decides on paired rounds (Search.measure_together)."""
        queues = [self.replay.get((c.key, phase)) for c in candidates]
        if all(queues):
            self.reused += len(candidates)
            stored = [q.pop(0) for q in queues if q]
            self.results.extend(stored)
            return [self._to_measurement(r, c, phase, seconds=0.0) for r, c in zip(stored, candidates)]
        plans = [PRESETS[c.variant].with_changes(batch_size=c.batch_size) for c in candidates]
        workloads = [
            replace(
                self.workload,
                batch_size=c.batch_size,
                min_seconds=self.final_seconds,
                min_iters=max(self.workload.min_iters, 5),
            )
            for c in candidates
        ]
        check_quality = self.quality is not None and any(c.variant not in self._quality_by_variant for c in candidates)
        self.console.print(f"[dim]  {phase:8s} {' vs '.join(c.key for c in candidates)}, side by side ...[/]")
        t0 = time.perf_counter()
        results = measure_plans(
            self.spec,
            plans,
            workloads,
            device=self.device,
            quality=self.quality if check_quality else None,
            tolerance=self.tolerance,
            timeout_s=self.timeout_s,
            kind="tune",
            tag=None,
            group_id=self.group_id,
            console=self.console,
        )
        cost = (time.perf_counter() - t0) / len(candidates)
        out = []
        for candidate, result in zip(candidates, results):
            if check_quality and result.ok and result.quality is not None:
                self._quality_by_variant.setdefault(candidate.variant, label(result.quality))
            out.append(self._keep(result, candidate, phase, cost))
        return out

    def _keep(self, result: Result, candidate: Candidate, phase: Phase, cost: float) -> Measurement:
        result.metrics.update(
            {
                K.TUNE_CANDIDATE: candidate.key,
                K.TUNE_PHASE: phase,
                K.TUNE_SEQ: len(self.results),
                K.TUNE_COST_S: cost,
                K.TUNE_QUALITY: self._quality_by_variant.get(candidate.variant),
            }
        )
        if self.store is not None:
            self.store.add(result)
        self.results.append(result)
        return self._to_measurement(result, candidate, phase, seconds=cost)

    def _to_measurement(self, result: Result, candidate: Candidate, phase: Phase, seconds: float) -> Measurement:
        m = result.metrics
        rounds = [r for r in m.get(K.ROUNDS) or [] if isinstance(r, dict)]
        latency = m.get(K.E2E_MS if result.workload.get("scenario") == "generate" else K.LATENCY_MS) or {}
        return Measurement(
            candidate=candidate,
            phase=phase,
            status=result.status,
            throughput=m.get(K.THROUGHPUT),
            p50_ms=latency.get("p50"),
            p99_ms=latency.get("p99"),
            memory_mb=m.get(K.PEAK_MEMORY_MB),
            quality=m.get(K.TUNE_QUALITY),
            cv=latency.get("cv", 0.0) / max(latency.get("n", 1), 1) ** 0.5,  # noise of the mean, not of one call
            seconds=seconds or m.get(K.TUNE_COST_S, 0.0),
            reason=result.reason,
            run_id=result.run_id,
            rates=tuple(float(r["rate"]) for r in rounds) if phase == "final" else (),
            usable=tuple(bool(r.get("used", True)) for r in rounds) if phase == "final" else (),
        )
