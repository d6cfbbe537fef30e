"""One measurement: a (ModelSpec, Plan, Workload) in its own child process -> a Result.

The child (`accelab.benchmark.child`) loads the plan and answers timed rounds; this side drives it
through `accelab.benchmark.rounds` (the same driver as compare's alternating rounds, with one plan):
a few rounds, the machine's noise measured around each, unreliable rounds left out of the
figures and the row marked when too few were quiet. The Result is returned, not stored (see
`Store.add`). Its metric keys are `accelab.results.contract.FORWARD` and `GENERATE`.
"""

from __future__ import annotations

from rich.console import Console

from accelab.benchmark.child import BenchJob, BenchOutput, measure_in_child
from accelab.benchmark.rounds import RoundsConfig, measure_plans
from accelab.catalog.spec import ModelSpec
from accelab.plan.plan import Plan
from accelab.quality.collect import QualityConfig
from accelab.results.result import Result
from accelab.scenarios.workload import Workload

__all__ = ["BenchJob", "BenchOutput", "bench", "measure_in_child"]


def bench(
    spec: ModelSpec,
    plan: Plan,
    workload: Workload,
    *,
    device: str | None = None,
    timeout_s: float = 1800.0,
    kind: str = "bench",
    tag: str | None = None,
    group_id: str | None = None,
    env: dict[str, str] | None = None,
    quality: QualityConfig | None = None,
    tolerance: str = "balanced",
    rounds: RoundsConfig | None = None,
    console: Console | None = None,
) -> Result:
    """Measure in a child process and return the Result (not stored: see `Store.add`).

    `workload.batch_size` is the run's batch size as the caller resolved it (`resolve_batch_size`);
    the plan's batch_size is not read here. With `quality`, the same child also collects outputs
    on the real inputs and the Result's `quality` holds the verdict against the fp32 eager
    reference (computed once, cached)."""
    (result,) = measure_plans(
        spec,
        [plan],
        [workload],
        device=device,
        quality=quality,
        tolerance=tolerance,
        timeout_s=timeout_s,
        kind=kind,
        tag=tag,
        group_id=group_id,
        env=env,
        config=rounds or RoundsConfig.single(),
        console=console or Console(stderr=True, quiet=True),
    )
    return result
