"""Several plans side by side: each in its own child process, one shared group id."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from rich.console import Console

from accelab.bench.engine import bench
from accelab.catalog.spec import ModelSpec
from accelab.measure.budget import PlanBudget
from accelab.plan.plan import Plan
from accelab.quality.collect import QualityConfig
from accelab.results.result import Result, new_run_id
from accelab.scenarios.workload import Workload, resolve_batch_size

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
    budget: PlanBudget | None = None,
) -> list[Result]:
    """Bench every plan; a plan that fails gives a row with its error and the others still run.
    A plan past its `budget` (see accelab.measure.budget) is stopped, and its row says so.
    `workload.batch_size` is the rows' shared batch: a plan with its own batch_size runs at that."""
    from accelab.measure.capabilities import plan_techniques

    console = console or Console(stderr=True)
    budget = budget or PlanBudget()
    group = new_run_id()
    results = []
    reference_s: float | None = None
    for i, plan in enumerate(plans, 1):
        used = plan_techniques(plan)
        seconds = budget.seconds_for(used, reference_s)
        why = budget.expected_slow(used)
        limit = f"; stopped after {seconds:.0f} s" if seconds else ""
        console.print(f"[dim][{i}/{len(plans)}] {spec.name}: plan {plan.name}...[/]"
                      + (f" [yellow]expected slow here ({why}){limit}[/]" if why else ""))
        row = replace(workload, batch_size=resolve_batch_size(None, plan, workload.batch_size))
        started = time.perf_counter()
        try:
            result = bench(
                spec, plan, row, device=device, timeout_s=min(timeout_s, seconds or timeout_s), kind="compare",
                tag=tag, group_id=group, quality=quality, tolerance=tolerance,
            )
        except Exception as err:  # noqa: BLE001 - e.g. the reference failed: keep the row, go on
            log.exception("plan %s failed", plan.name)
            result = Result(
                kind="compare", status="error", model=spec.to_dict(), plan=plan.to_dict(),
                workload=row.to_dict(), reason=f"{type(err).__name__}: {err}", group_id=group, tag=tag,
            )
        if result.status == "timeout" and seconds and seconds < timeout_s:
            result.status, result.reason = "stopped", budget.stopped_reason(seconds, used)
        if reference_s is None and result.ok:
            reference_s = time.perf_counter() - started  # the first plan that ran: the others' yardstick
        results.append(result)
    return results
