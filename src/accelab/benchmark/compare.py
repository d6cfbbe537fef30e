"""Several plans side by side: each in its own warm child, measured in alternating rounds
(`accelab.benchmark.rounds`), one shared group id; each row after the reference carries its paired
speed-up with a confidence interval."""

from __future__ import annotations

import logging

from rich.console import Console

from accelab.benchmark.rounds import RoundsConfig, measure_plans, with_rows
from accelab.catalog.spec import ModelSpec
from accelab.measure.budget import PlanBudget
from accelab.plan.plan import Plan
from accelab.quality.collect import QualityConfig, config_for
from accelab.results.result import Result, new_run_id
from accelab.scenarios.workload import Workload

log = logging.getLogger(__name__)


def quality_config_for(task: str, workload: Workload, samples: int | None, batch_size: int) -> QualityConfig:
    """The quality guard of a compare or bench row; `samples` None: verify's default for the task."""
    return config_for(task, samples, new_tokens=min(workload.new_tokens, 16), batch_size=batch_size)


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
    rounds: RoundsConfig | None = None,
) -> list[Result]:
    """Measure every plan; a plan that fails gives a row with its error and the others still run.
    A plan past its `budget` (see accelab.measure.budget) is stopped, and its row says so.
    `workload.batch_size` is the rows' shared batch: a plan with its own batch_size runs at that."""
    console = console or Console(stderr=True)
    return measure_plans(
        spec,
        plans,
        with_rows(workload, plans),
        device=device,
        quality=quality,
        tolerance=tolerance,
        timeout_s=timeout_s,
        kind="compare",
        tag=tag,
        group_id=new_run_id(),
        budget=budget,
        config=rounds,
        console=console,
    )
