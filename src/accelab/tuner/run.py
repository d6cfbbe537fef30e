"""A whole tune, from the request to the Plan file: resolve the space, search it, print the table,
draw the Pareto chart, store every measurement, write the winner. `accelab tune` and
`accelab.tune()` are thin adapters over `tune(request)`."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, get_args

from rich.console import Console
from rich.markup import escape

from accelab.benchmark.options import default_scenario, validate
from accelab.catalog.spec import ModelSpec
from accelab.measure import noise
from accelab.plan.plan import Plan
from accelab.plan.presets import PRESETS
from accelab.quality.collect import config_for
from accelab.quality.verdict import LEVELS, rules_for
from accelab.results.store import Store, open_store
from accelab.results.table import make_console
from accelab.scenarios.workload import Workload, resolve_batch_size
from accelab.tuner import report
from accelab.tuner.measure import BenchMeasurer
from accelab.tuner.search import Constraints, Goal, QualityLevel, Search, SearchLog
from accelab.tuner.space import Space, search_space
from accelab.units import parse_duration_s, parse_size_mib

TuneGoal = Literal["throughput", "latency"]
Percentile = Literal["p50", "p99"]  # of the latency goal
TuneScenario = Literal["forward", "generate", "auto"]
GOALS: tuple[TuneGoal, ...] = get_args(TuneGoal)
PERCENTILES: tuple[Percentile, ...] = get_args(Percentile)
TUNE_SCENARIOS: tuple[TuneScenario, ...] = get_args(TuneScenario)


def check_options(*, goal: str, percentile: str, quality: str, max_memory: str | None, budget: str | None) -> None:
    """The checks that need no model: `accelab tune` makes them before it resolves (downloads) one."""
    if goal not in GOALS:
        raise ValueError(f"--goal {goal!r} must be throughput or latency")
    if percentile not in PERCENTILES:
        raise ValueError(f"--percentile {percentile!r} must be p50 or p99")
    if quality not in (*LEVELS, "off"):
        raise ValueError(f"--quality {quality!r} must be one of strict, balanced, loose, off")
    if max_memory:
        parse_size_mib(max_memory, "--max-memory")
    if budget:
        parse_duration_s(budget, "--budget")


@dataclass(frozen=True, kw_only=True, slots=True)
class TuneRequest:
    """What a tune was asked: the model, the goal, the limits, the shapes and where results go."""

    spec: ModelSpec
    goal: TuneGoal = "throughput"
    percentile: Percentile = "p99"  # for the latency goal
    scenario: TuneScenario = "auto"  # checked by the Workload it becomes
    batch_size: int | None = None  # latency: the request batch; throughput: the screening batch
    max_batch: int | None = None
    seq_len: int = 128
    new_tokens: int = 32
    image_size: int | None = None
    max_memory: str | None = None  # "2GiB": GPU memory, or process RSS on CPU
    p99_ms: float | None = None
    quality: QualityLevel = "balanced"
    budget: str | None = None  # "10m": wall time of the whole search
    include: list[str] | None = None
    exclude: list[str] | None = None
    min_seconds: float = 3.0
    device: str | None = None
    out: Path | None = None  # the winning Plan's YAML
    plot: Path | None = None  # the Pareto chart's PNG
    json_out: Path | None = None
    db: str | Path | None = None
    fresh: bool = False  # ignore earlier measurements of the same tune in the store

    def __post_init__(self) -> None:
        check_options(
            goal=self.goal,
            percentile=self.percentile,
            quality=self.quality,
            max_memory=self.max_memory,
            budget=self.budget,
        )


@dataclass(kw_only=True, slots=True)
class TuneOutcome:
    setup: TuneSetup
    group: str  # the tune id: the group_id of its Results
    log: SearchLog
    measurer: BenchMeasurer
    plan: Plan | None = None  # the winner; None when no plan met every limit
    notes: list[str] = field(default_factory=list)

    @property
    def no_feasible_reason(self) -> str | None:
        return self.log.no_feasible_reason


@dataclass(frozen=True, kw_only=True, slots=True)
class TuneSetup:
    spec: ModelSpec
    workload: Workload
    space: Space
    goal: Goal
    constraints: Constraints
    screen_batch: int
    tolerance: str
    budget_s: float | None

    @property
    def unit(self) -> str:
        return "tokens/s" if self.workload.scenario == "generate" else "items/s"


def setup_of(request: TuneRequest) -> TuneSetup:
    """The workload, the space (pruned for this device) and the limits a request searches."""
    spec, goal, quality = request.spec, request.goal, request.quality
    chosen = default_scenario(spec.task) if request.scenario == "auto" else request.scenario
    generate = chosen == "generate"
    screen = resolve_batch_size(request.batch_size, None, 1 if goal == "latency" else 4 if generate else 8)
    ladder_top = request.max_batch or (64 if generate else 256)
    if goal == "throughput":
        screen = min(screen, ladder_top)
    workload = Workload(
        scenario=chosen,
        batch_size=screen,
        seq_len=request.seq_len,
        new_tokens=request.new_tokens,
        image_size=request.image_size,
        min_seconds=request.min_seconds,
    )
    validate(spec, workload)
    if quality != "off":
        rules_for(spec.task, quality)
    space = search_space(
        spec,
        chosen,
        request.device,
        max_batch=ladder_top if goal == "throughput" else screen,
        include=request.include,
        exclude=request.exclude,
        # a slow technique cannot win on speed, but may fit a memory limit where fp32 does not
        prune_slow=request.include is None and request.max_memory is None,
    )
    if goal == "latency":
        space = Space(variants=space.variants, pruned=space.pruned, batch_sizes=[screen])
    constraints = Constraints(
        max_memory_mb=parse_size_mib(request.max_memory) if request.max_memory else None,
        p99_ms=request.p99_ms,
        quality=quality,
    )
    return TuneSetup(
        spec=spec,
        workload=workload,
        space=space,
        goal="throughput" if goal == "throughput" else "latency-p50" if request.percentile == "p50" else "latency-p99",
        constraints=constraints,
        screen_batch=screen,
        tolerance=quality if quality != "off" else "balanced",
        budget_s=parse_duration_s(request.budget) if request.budget else None,
    )


def tune_id(setup: TuneSetup) -> str:
    """Same model, workload, space, goal and limits -> same id, so a rerun resumes."""
    blob = json.dumps(
        [
            setup.spec.to_dict(),
            setup.workload.to_dict(),
            setup.space.variants,
            setup.space.batch_sizes,
            setup.goal,
            asdict(setup.constraints),
            setup.screen_batch,
            setup.tolerance,
        ],
        sort_keys=True,
        default=str,
    )
    return "tune-" + hashlib.sha256(blob.encode()).hexdigest()[:12]


def run_tune(
    setup: TuneSetup,
    *,
    store: Store | None,
    device: str | None,
    fresh: bool,
    console: Console,
    quality_samples: int | None = None,
) -> tuple[SearchLog, BenchMeasurer, str]:
    group = tune_id(setup)
    quality = None
    if setup.constraints.quality != "off":
        # a tune's sample per task (an interval that can clear the lines), without the greedy
        # continuations: they are reported, never judged, and a tune only needs the verdict
        quality = config_for(setup.spec.task, quality_samples, tune=True, new_tokens=0, batch_size=8)
    measurer = BenchMeasurer(
        spec=setup.spec,
        workload=setup.workload,
        device=device,
        store=store,
        group_id=group,
        quality=quality,
        tolerance=setup.tolerance,
        screen_seconds=min(setup.workload.min_seconds, 1.0),
        final_seconds=setup.workload.min_seconds,
        console=console,
    )
    if not fresh:
        found = measurer.load_replay()
        if found:
            console.print(f"resuming tune {group}: {found} earlier measurements in the store will be reused")
    search = Search(
        variants=setup.space.variants,
        batch_sizes=setup.space.batch_sizes,
        measure=measurer,
        measure_together=measurer.together,
        constraints=setup.constraints,
        goal=setup.goal,
        screen_batch=setup.screen_batch,
        budget_s=setup.budget_s,
    )
    return search.run(), measurer, group


def winning_plan(log: SearchLog, group: str) -> Plan | None:
    if log.winner is None:
        return None
    c = log.winner.candidate
    return PRESETS[c.variant].with_changes(name=f"tuned-{c.variant}-b{c.batch_size}", batch_size=c.batch_size)


def write_plan(plan: Plan, path: Path, header: str) -> None:
    path.write_text("".join(f"# {line}\n" for line in header.splitlines()) + plan.to_yaml())


# -- the whole tune -------------------------------------------------------------------------------
def tune(request: TuneRequest, console: Console | None = None) -> TuneOutcome:
    """Search, print the table, draw and write what the request asks; the outcome's plan is the
    winner (None when no plan met every limit: then nothing is written but the table and JSON)."""
    console = console or make_console()
    setup = setup_of(request)
    space = setup.space
    console.print(
        f"tuning {setup.spec.name} ({setup.workload.scenario}) for {setup.goal}: {len(space.variants)} plans x batches "
        f"{space.batch_sizes[0]}..{space.batch_sizes[-1]}; limits: "
        f"memory {request.max_memory or '-'}, p99 {request.p99_ms or '-'} ms, quality {request.quality}"
    )
    noise.warn_if_busy(lambda text: console.print(f"[yellow]warning: {escape(text)}[/]"))
    log, measurer, group = run_tune(
        setup, store=open_store(request.db), device=request.device, fresh=request.fresh, console=console
    )
    outcome = TuneOutcome(setup=setup, group=group, log=log, measurer=measurer, plan=winning_plan(log, group))
    report.render(log, space.pruned, setup.unit, console)
    if request.plot:
        report.plot_pareto(
            log, request.plot, setup.unit, f"{setup.spec.name} · {setup.workload.scenario} · tune {group}"
        )
        console.print(f"Pareto chart: {request.plot}")
    if request.json_out:
        request.json_out.write_text(json.dumps(summary_json(outcome), indent=2))
    if outcome.plan is None:
        console.print(f"[bold red]{log.no_feasible_reason}[/]")
        return outcome
    w = log.winner
    assert w is not None
    tie = f" (a tie with {log.runner_up.candidate.key}: {_tie_words(log)})" if log.tie and log.runner_up else ""
    if request.out:
        write_plan(outcome.plan, request.out, plan_header(request, outcome))
        console.print(f"[bold green]best plan: {w.candidate.key}{tie}[/] -> {request.out}")
    else:
        console.print(f"[bold green]best plan: {w.candidate.key}{tie}[/]")
    if log.budget_spent:
        console.print("[yellow]the --budget ran out: this is the best plan measured so far[/]")
    return outcome


def _tie_words(log: SearchLog) -> str:
    """Why the final is a tie: the paired ratio's reason when measured side by side."""
    return log.final_ratio.split(": ", 1)[1] if log.final_ratio else "within noise"


def summary_json(outcome: TuneOutcome) -> dict:
    log = outcome.log
    return {
        "tune_id": outcome.group,
        "winner": log.winner and log.winner.candidate.key,
        "runner_up": log.runner_up and log.runner_up.candidate.key,
        "tie": log.tie,
        "final_ratio": log.final_ratio,
        "measured_seconds": log.measured_seconds,
        "reused": outcome.measurer.reused,
        "verdicts": log.verdicts,
        "pruned": outcome.setup.space.pruned,
        "no_feasible_reason": log.no_feasible_reason,
        "run_ids": [r.run_id for r in outcome.measurer.results],
    }


def plan_header(request: TuneRequest, outcome: TuneOutcome) -> str:
    """The comment block of the Plan file: how it was found, what it measured, how to rerun it."""
    log, setup = outcome.log, outcome.setup
    w = log.winner
    assert w is not None
    name = setup.spec.name
    return (
        f"accelab tune {name} --goal {request.goal} ({setup.goal}), tune id {outcome.group}\n"
        f"winner {w.candidate.key}: {w.throughput:.4g} {setup.unit}, p50 {w.p50_ms:.4g} ms, p99 {w.p99_ms:.4g} ms, "
        f"peak {w.memory_mb:.0f} MB, quality {w.quality or 'not checked'}\n"
        + (f"tie with {log.runner_up.candidate.key} ({_tie_words(log)})\n" if log.tie and log.runner_up else "")
        + f"reproduce: accelab bench {name} --plan {request.out} --scenario {setup.workload.scenario}"
    )
