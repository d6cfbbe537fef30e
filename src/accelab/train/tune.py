"""`accelab train --tune`: the training plan chosen by measurement, with a convergence verdict.

Recipe:
1. Candidates (`tune_space`): the baseline (the user's options) and one change at a time.
2. Screening: every candidate trains `--tune-steps` optimizer steps, all at once and taking turns
   (`bench.run_bench`: interleaved rounds, noise per window, a paired speed-up with its interval
   over the baseline, as `compare` measures). Out: what cannot run here, what failed, what went
   over `--max-memory`, what was measurably slower.
3. Finalists: the combination of the fastest change per axis that screened faster, then the
   faster single changes, then those the screening could not tell from the baseline (a plan as
   fast per sample may still reach the target sooner: the convergence runs decide).
4. Convergence: two seeds of the baseline and every finalist train `--tune-epochs` epochs, again
   taking turns, evaluating at the same samples seen; each finalist's loss curve is judged against
   the seeds' band (`convergence`), its eval score against the seeds' with an interval.
5. The winner: the shortest time-to-target (training wall time to the worse baseline seed's
   final eval score less the seeds' spread) among the plans that converge like the baseline and
   fit the memory limit; the baseline when none does. Written as a train plan (`plan_file`) that
   `accelab train --plan` trains with.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accelab.measure.budget import PlanBudget
from accelab.results import contract as K
from accelab.results.result import Result
from accelab.train import convergence as conv
from accelab.train.bench import BenchRow, run_bench
from accelab.train.config import TrainConfig
from accelab.train.eval_interval import eval_difference
from accelab.train.tune_space import BASELINE, Candidate, Screened, finalists

log = logging.getLogger(__name__)

CONVERGES = "converges like the baseline"
SEEDS = (0, 1)  # baseline seeds: the band of seed-to-seed spread
EVALS_PER_EPOCH = 8  # eval points of a convergence run (at the same samples seen for every plan)


@dataclass(frozen=True, kw_only=True, slots=True)
class TuneSettings:
    screen_steps: int = 30
    epochs: int = 2
    finalists: int = 3
    max_memory_mib: float | None = None
    budget_s: float | None = None
    timeout_s: float = 7200.0


@dataclass(kw_only=True, slots=True)
class Judged:
    """A plan after its convergence run."""

    candidate: Candidate
    result: Result
    verdict: str  # convergence label, or "baseline" for the seeds
    reason: str
    time_to_target_s: float | None = None
    eval_difference: str = ""
    out: str | None = None  # why it is not the winner


@dataclass(kw_only=True, slots=True)
class TuneOutcome:
    screened: list[Screened]
    screen_results: list[Result]
    judged: list[Judged] = field(default_factory=list)
    winner: Judged | None = None
    target: float | None = None
    metric: conv.Metric = "accuracy"
    notes: list[str] = field(default_factory=list)


def memory_mib(result: Result) -> float | None:
    """GPU: torch's peak allocation on the busiest rank; CPU: the RSS peaks of all ranks summed
    (they share the machine's memory)."""
    m = result.metrics
    return m.get(K.GPU_PEAK_ALLOCATED_MB_MAX) or m.get(K.PEAK_RSS_MB_SUM)


def screen(
    config: TrainConfig,
    spec: Any,
    space: list[Candidate],
    settings: TuneSettings,
    *,
    idle: float | None,
    tag: str | None,
) -> tuple[list[Screened], list[Result]]:
    """Step 2 of the recipe: short interleaved runs of every candidate."""
    short = config.with_changes(
        max_steps=settings.screen_steps,
        timing_warmup=2,
        eval_every=None,
        output_dir=str(Path(config.output_dir) / "screening"),  # its rows and turns apart from the convergence runs'
    )
    rows = [c.row() for c in space]
    # turns of a few steps: a single step after a pause runs slow (threads wake, caches refill)
    results = run_bench(short, spec, rows, timeout_s=settings.timeout_s, idle=idle, tag=tag, budget=PlanBudget())
    return [_screened(c, r, settings) for c, r in zip(space, results)], results


def _screened(candidate: Candidate, result: Result, settings: TuneSettings) -> Screened:
    speedup = result.metrics.get(K.SPEEDUP) or {}
    value, verdict = speedup.get("value"), speedup.get("verdict")
    out = None
    used = memory_mib(result)
    if not result.ok:
        out = f"{result.status}: {result.reason}"
    elif settings.max_memory_mib is not None and used is not None and used > settings.max_memory_mib:
        out = f"over the memory limit: {used:.0f} MiB > {settings.max_memory_mib:.0f} MiB"
    elif candidate.name != BASELINE and verdict == "slower":
        out = f"slower: {speedup.get('reason') or verdict}"
    return Screened(candidate=candidate, speedup=value, verdict=verdict, out=out)


def convergence_rows(
    config: TrainConfig, chosen: list[Candidate], epochs: int, steps: int | None, samples_per_epoch: int
) -> list[BenchRow]:
    """The baseline seeds and each finalist, evaluated EVALS_PER_EPOCH times an epoch at the same
    samples seen whatever their batch; `steps` (in baseline batches) shortens every run alike."""
    total = steps * config.batch_size if steps is not None else epochs * samples_per_epoch
    samples_per_eval = max(1, total // (EVALS_PER_EPOCH * epochs))

    def row(name: str, candidate: Candidate, seed: int) -> BenchRow:
        batch = candidate.changes.get("batch_size", config.batch_size)
        extra: dict[str, Any] = {
            "seed": seed,
            "epochs": epochs,
            "eval_every": max(1, round(samples_per_eval / batch)),
            "timing_warmup": 0,
        }
        if steps is not None:
            extra["max_steps"] = max(1, total // batch)
        return BenchRow(name=name, changes={**candidate.changes, **extra}, nproc=candidate.nproc)

    base = Candidate(name=BASELINE, axis=BASELINE)
    return [row(f"{BASELINE} (seed {s})", base, s) for s in SEEDS] + [row(c.name, c, 0) for c in chosen]


def converge(
    config: TrainConfig,
    spec: Any,
    chosen: list[Candidate],
    settings: TuneSettings,
    *,
    idle: float | None,
    tag: str | None,
    steps: int | None,
    samples_per_epoch: int,
) -> list[tuple[Candidate, Result]]:
    """Step 4: the baseline seeds and the finalists trained to convergence, taking turns."""
    rows = convergence_rows(config, chosen, settings.epochs, steps, samples_per_epoch)
    config = config.with_changes(output_dir=str(Path(config.output_dir) / "convergence"))
    results = run_bench(config, spec, rows, timeout_s=settings.timeout_s, idle=idle, tag=tag, budget=PlanBudget())
    base = Candidate(name=BASELINE, axis=BASELINE)
    return list(zip([base, base, *chosen], results))


def curve_of(result: Result) -> conv.Curve:
    m = result.metrics
    return conv.Curve.of(m.get(K.LOSSES) or [], int(result.workload["global_batch"]), m.get(K.EVALS) or [])


def judge_all(runs: list[tuple[Candidate, Result]], settings: TuneSettings, task: str) -> TuneOutcome:
    """Step 4's verdicts and step 5's winner."""
    metric: conv.Metric = "accuracy" if task == "image-classification" else "perplexity"
    seeds = [r for c, r in runs[: len(SEEDS)]]
    outcome = TuneOutcome(screened=[], screen_results=[], metric=metric)
    if not all(r.ok for r in seeds):
        bad = next(r for r in seeds if not r.ok)
        outcome.notes.append(f"a baseline seed did not finish ({bad.status}: {bad.reason}); no verdicts")
        return outcome
    curves = [curve_of(r) for r in seeds]
    band = conv.Band.of(curves)
    outcome.target = target_of(curves, metric)
    for i, (candidate, result) in enumerate(runs):
        outcome.judged.append(_judge_one(candidate, result, i < len(SEEDS), band, curves, outcome, settings))
    _pick_winner(outcome)
    return outcome


def target_of(seeds: list[conv.Curve], metric: conv.Metric) -> float:
    """The eval score a plan must reach: the worse seed's final score, less the seeds' spread (the
    range of their final scores). Every seed reaches it, so the baseline has a time-to-target of
    its own, and a plan whose final score is within the baseline's seed-to-seed noise reaches it
    too (as MLPerf sets its targets a little below the reference's converged quality)."""
    finals = [curve.final(metric) for curve in seeds]
    spread = max(finals) - min(finals)
    return min(finals) - spread if conv.HIGHER_IS_BETTER[metric] else max(finals) + spread


def _judge_one(
    candidate: Candidate,
    result: Result,
    is_seed: bool,
    band: conv.Band,
    seeds: list[conv.Curve],
    outcome: TuneOutcome,
    settings: TuneSettings,
) -> Judged:
    if not result.ok:
        return Judged(
            candidate=candidate,
            result=result,
            verdict="failed",
            reason=f"{result.status}: {result.reason}",
            out="it did not finish",
        )
    curve = curve_of(result)
    ttt = conv.time_to_target(curve.evals, outcome.target, outcome.metric) if outcome.target is not None else None
    if is_seed:
        judged = Judged(
            candidate=candidate, result=result, verdict="baseline", reason="a seed of the band", time_to_target_s=ttt
        )
    else:
        verdict = conv.judge(curve, band)
        judged = Judged(
            candidate=candidate, result=result, verdict=verdict.label, reason=verdict.reason, time_to_target_s=ttt
        )
    score = _final_score(curve, outcome.metric)
    baseline_scores = [s for s in (_final_score(c, outcome.metric) for c in seeds) if s is not None]
    if score is not None and len(baseline_scores) >= 2 and not is_seed:
        difference = eval_difference(
            score,
            baseline_scores,
            eval_samples=curve.evals[-1].eval_samples if outcome.metric == "accuracy" else None,
            higher_is_better=conv.HIGHER_IS_BETTER[outcome.metric],
        )
        judged.eval_difference = f"{difference.difference:+.3g} ({difference.low:+.3g} to {difference.high:+.3g})"
    used = memory_mib(result)
    if settings.max_memory_mib is not None and used is not None and used > settings.max_memory_mib:
        judged.out = f"over the memory limit: {used:.0f} MiB > {settings.max_memory_mib:.0f} MiB"
    elif judged.verdict not in ("baseline", CONVERGES):
        judged.out = judged.verdict
    return judged


def _final_score(curve: conv.Curve, metric: conv.Metric) -> float | None:
    try:
        return curve.final(metric)
    except ValueError:  # no evals, or not this metric
        return None


def _pick_winner(outcome: TuneOutcome) -> None:
    """The shortest time-to-target among the eligible plans (seed 0 of the baseline stands for the
    baseline); a plan that never reached the target ranks after every plan that did, by samples/s."""
    eligible = [j for i, j in enumerate(outcome.judged) if j.out is None and i != 1]
    if not eligible:
        return

    def key(j: Judged) -> tuple[float, float]:
        reached = j.time_to_target_s if j.time_to_target_s is not None else math.inf
        return (reached, -(j.result.metrics.get(K.SAMPLES_PER_S) or 0.0))

    ranked = sorted(eligible, key=key)
    outcome.winner = ranked[0]
    best = ranked[0].time_to_target_s
    for j in ranked[1:]:
        if j.time_to_target_s is None:
            j.out = "never reached the target"
        else:
            j.out = (
                f"slower to the target: {j.time_to_target_s:.1f} s vs {best:.1f} s" if best else "slower to the target"
            )


def tune(
    config: TrainConfig,
    spec: Any,
    space: list[Candidate],
    settings: TuneSettings,
    *,
    idle: float | None,
    tag: str | None = None,
    say: Callable[[str], None] = lambda line: None,
) -> TuneOutcome:
    """The whole recipe of the module docstring."""
    started = time.monotonic()
    say(
        f"screening {sum(c.unsupported is None for c in space)} plans, {settings.screen_steps} steps each, taking turns"
    )
    screened, screen_results = screen(config, spec, space, settings, idle=idle, tag=tag)
    if not screen_results[0].ok:
        raise RuntimeError(f"the baseline did not train: {screen_results[0].status}: {screen_results[0].reason}")
    chosen = finalists(screened, settings.finalists)
    steps, note = _fit_budget(settings, screen_results, chosen, time.monotonic() - started)
    say(
        f"training {len(chosen)} finalist(s) and {len(SEEDS)} baseline seeds, {settings.epochs} epoch(s) each"
        + (f" ({note})" if note else "")
    )
    base = screen_results[0].metrics
    samples_per_epoch = int(base.get(K.STEPS_PER_EPOCH) or 1) * config.batch_size
    runs = converge(
        config, spec, chosen, settings, idle=idle, tag=tag, steps=steps, samples_per_epoch=samples_per_epoch
    )
    outcome = judge_all(runs, settings, config.task)
    outcome.screened, outcome.screen_results = screened, screen_results
    outcome.notes += [note] if note else []
    return outcome


def _fit_budget(
    settings: TuneSettings, screen_results: list[Result], chosen: list[Candidate], spent_s: float
) -> tuple[int | None, str | None]:
    """Steps of the convergence runs (in baseline batches): None for the full epochs when they fit
    in what is left of --budget; estimated from the screening runs' rates (turns: the runs' times add up)."""
    if settings.budget_s is None:
        return None, None
    base = screen_results[0]
    rate = base.metrics.get(K.SAMPLES_PER_S)
    steps_per_epoch = base.metrics.get(K.STEPS_PER_EPOCH)
    if not rate or not steps_per_epoch:
        return None, None
    batch = int(base.workload["global_batch"])
    runs = len(SEEDS) + len(chosen)
    full_steps = settings.epochs * int(steps_per_epoch)
    seconds = runs * full_steps * batch / rate * 1.5  # evaluations, start-up and turns on top
    left = settings.budget_s - spent_s
    if seconds <= left:
        return None, None
    steps = max(4, int(full_steps * max(left, 0.0) / seconds))
    return steps, f"shortened to {steps} baseline steps to fit --budget ({left:.0f} s left)"
