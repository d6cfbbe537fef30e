"""Several plans side by side: each in its own child process, one shared group id."""

from __future__ import annotations

import logging

from rich.console import Console

from accelab.bench.engine import bench
from accelab.catalog.spec import ModelSpec
from accelab.plan.plan import Plan
from accelab.quality.collect import QualityConfig
from accelab.results.result import Result, new_run_id
from accelab.scenarios.workload import Workload

log = logging.getLogger(__name__)


def quality_config_for(workload: Workload, samples: int, batch_size: int) -> QualityConfig:
    return QualityConfig(samples=samples, new_tokens=min(workload.new_tokens, 16), batch_size=batch_size)


def run_compare(
    spec: ModelSpec,
    plans: list[Plan],
    workload: Workload,
    *,
    device: str | None = None,
    quality: QualityConfig | None = None,
    tolerance: str = "balanced",
    timeout_s: float = 1800.0,
    tag: str | None = None,
    console: Console | None = None,
) -> list[Result]:
    """Bench every plan; a plan that fails gives a row with its error and the others still run."""
    console = console or Console(stderr=True)
    group = new_run_id()
    results = []
    for i, plan in enumerate(plans, 1):
        console.print(f"[dim][{i}/{len(plans)}] {spec.name}: plan {plan.name}...[/]")
        try:
            result = bench(
                spec, plan, workload, device=device, timeout_s=timeout_s, kind="compare",
                tag=tag, group_id=group, quality=quality, tolerance=tolerance,
            )
        except Exception as err:  # noqa: BLE001 - e.g. the reference failed: keep the row, go on
            log.exception("plan %s failed", plan.name)
            result = Result(
                kind="compare", status="error", model=spec.to_dict(), plan=plan.to_dict(),
                workload=workload.to_dict(), reason=f"{type(err).__name__}: {err}", group_id=group, tag=tag,
            )
        results.append(result)
    return results
