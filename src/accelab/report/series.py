"""Plot-ready series from Results: latency CDFs, batch-size curves, Pareto fronts, load curves and
training curves. Pure: no matplotlib, no I/O; every extractor returns [] when its data is absent,
so that a report section with nothing to draw is left out instead of drawing an empty chart.

Every kind is read by the keys its producer writes, as `accelab.results.contract` names them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from accelab.report import metrics as M
from accelab.results import contract as K
from accelab.results.result import Result
from accelab.tuner.search import PHASE_RANK

# -- plan labels --------------------------------------------------------------------------------


def plan_identity(plan: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """A plan without its batch size: one line on a batch-size chart."""
    return tuple(sorted((k, repr(v)) for k, v in plan.items() if k != "batch_size"))


def plan_labels(results: list[Result]) -> dict[str, str]:
    """run_id -> a plan label that tells apart plans sharing a name ("baseline (threads=1)")."""
    by_name: dict[str, set] = defaultdict(set)
    for r in results:
        by_name[M.plan_name(r)].add(plan_identity(r.plan))
    labels = {}
    for r in results:
        name = M.plan_name(r)
        if len(by_name[name]) == 1:
            labels[r.run_id] = name
            continue
        others = [dict(i) for i in by_name[name] if i != plan_identity(r.plan)]
        mine = dict(plan_identity(r.plan))
        differing = sorted(k for k in mine if any(o.get(k) != mine[k] for o in others) and k != "name")
        shown = ", ".join(f"{k}={r.plan.get(k)}" for k in differing)
        labels[r.run_id] = f"{name} ({shown})" if shown else name
    return labels


def _unique(labels: list[str], results: list[Result]) -> list[str]:
    """Add the run id where two lines of one chart would carry the same label."""
    return [f"{label} · {r.run_id[:6]}" if labels.count(label) > 1 else label for label, r in zip(labels, results)]


# -- latency distribution -------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class LatencyCurve:
    label: str
    xs: list[float]  # latency, ms
    ys: list[float]  # cumulative fraction, 0..1
    from_samples: bool  # False: drawn through the stored percentiles only
    stats: dict[str, float]


@dataclass(frozen=True, kw_only=True, slots=True)
class LatencyPanel:
    title: str
    curves: list[LatencyCurve]


def cdf_points(samples: list[float]) -> tuple[list[float], list[float]]:
    ordered = sorted(samples)
    n = len(ordered)
    return ordered, [(i + 1) / n for i in range(n)]


def percentile_points(stats: dict[str, float]) -> tuple[list[float], list[float]]:
    """The CDF through the percentiles a Result stores (min, p50, p90, p99, max)."""
    quantiles = (("min", 0.0), ("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0))
    pairs = [(x, q) for k, q in quantiles if (x := M.number(stats.get(k))) is not None]
    return [x for x, _ in pairs], [q for _, q in pairs]


def latency_panels(results: list[Result]) -> list[LatencyPanel]:
    """One panel per (model, workload): every plan's latency CDF, from raw samples when stored."""
    # tune trials are read on the Pareto chart, loadtests on the load curve
    measured = [r for r in results if r.ok and M.latency_stats(r) and r.kind not in ("tune", "loadtest")]
    labels = plan_labels(measured)
    groups: dict[tuple, list[Result]] = defaultdict(list)
    for r in measured:
        groups[(M.model_name(r), M.workload_key(r))].append(r)
    panels = []
    for members in groups.values():
        names = _unique([labels[r.run_id] for r in members], members)
        curves = []
        for name, r in zip(names, members):
            samples = M.latency_samples(r)
            xs, ys = cdf_points(samples) if samples else percentile_points(M.latency_stats(r) or {})
            curves.append(
                LatencyCurve(label=name, xs=xs, ys=ys, from_samples=bool(samples), stats=M.latency_stats(r) or {})
            )
        head = members[0]
        panels.append(LatencyPanel(title=f"{M.model_name(head)} · {M.workload_label(head)}", curves=curves))
    return panels


# -- throughput / memory against batch size -----------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class BatchLine:
    label: str
    points: list[tuple[int, float]]  # (batch size, value), by batch size


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchPanel:
    title: str
    ylabel: str
    lines: list[BatchLine]


def batch_panels(results: list[Result], what: str) -> list[BatchPanel]:
    """`what` is "throughput" or "memory". One panel per (model, scenario and shapes other than the
    batch); one line per plan; kept only when some line has two batch sizes or more. Repeated runs
    at one batch size: the newest counts."""
    read = {"throughput": M.throughput, "memory": M.peak_memory_mb}[what]
    measured = [
        r
        for r in results
        if r.ok
        and M.latency_stats(r)
        and read(r) is not None
        and M.batch_size(r)
        and r.kind not in ("tune", "loadtest")
    ]
    labels = plan_labels(measured)
    panels: dict[tuple, dict[tuple, dict[int, Result]]] = defaultdict(lambda: defaultdict(dict))
    for r in sorted(measured, key=lambda r: r.created):  # newest last, so it wins
        shape = tuple(v for k, v in zip(M.WORKLOAD_SHAPE, M.workload_key(r)) if k != "batch_size")
        panels[(M.model_name(r), shape)][plan_identity(r.plan)][M.known(M.batch_size(r))] = r
    out = []
    for (model, shape), lines in panels.items():
        drawn = []
        for by_batch in lines.values():
            first = next(iter(by_batch.values()))
            points = sorted((b, M.known(read(r))) for b, r in by_batch.items())
            drawn.append(BatchLine(label=labels[first.run_id], points=points))
        if not any(len(line.points) >= 2 for line in drawn):
            continue
        first = next(iter(next(iter(lines.values())).values()))
        unit = M.throughput_unit(first) if what == "throughput" else "MB"
        ylabel = f"throughput ({unit})" if what == "throughput" else "peak memory (MB)"
        scenario = shape[0] or first.kind
        out.append(BatchPanel(title=f"{model} · {scenario}", ylabel=ylabel, lines=drawn))
    return out


# -- Pareto front (tune) ------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class ParetoPoint:
    label: str
    throughput: float
    p99_ms: float
    memory_mb: float | None
    run_id: str


@dataclass(frozen=True, kw_only=True, slots=True)
class ParetoSet:
    title: str
    unit: str
    points: list[ParetoPoint]
    front_latency: list[int]  # indices into points: best throughput for its p99, by p99
    front_memory: list[int]  # best throughput for its memory, by memory


def pareto_front(costs: list[float], gains: list[float]) -> list[int]:
    """Indices of the points no other point beats: lower-or-equal cost AND higher-or-equal gain,
    strictly better in one. Returned by increasing cost."""
    order = sorted(range(len(costs)), key=lambda i: (costs[i], -gains[i]))
    front, best = [], float("-inf")
    for i in order:
        if gains[i] > best:
            front.append(i)
            best = gains[i]
    return front


def latest_per_candidate(results: list[Result]) -> list[Result]:
    """A tuner measures a candidate briefly, then again for longer: keep its longest (latest) run.
    Results that are no tune trial (no `tune_candidate`) are each their own candidate."""

    def rank(r: Result) -> tuple:
        return PHASE_RANK.get(r.metrics.get(K.TUNE_PHASE, ""), 0), r.metrics.get(K.TUNE_SEQ, 0), r.created

    chosen: dict[str, Result] = {}
    for r in results:
        key = r.metrics.get(K.TUNE_CANDIDATE) or r.run_id
        old = chosen.get(key)
        if old is None or rank(r) >= rank(old):
            chosen[key] = r
    return list(chosen.values())


def pareto_sets(results: list[Result], min_points: int = 3) -> list[ParetoSet]:
    """One set per group (group_id) of a tune run, or of any group with `min_points` measured
    plans: the trade-off of throughput against p99 latency and against peak memory. A group may
    span batch sizes (a tuner tries several), so its title names the workload without the batch."""
    groups: dict[str, list[Result]] = defaultdict(list)
    for r in results:
        if r.group_id and r.ok and M.throughput(r) is not None and M.stat(r, "p99") is not None:
            groups[r.group_id].append(r)
    out = []
    for group, all_members in groups.items():
        members = latest_per_candidate(all_members)
        if len(members) < min_points and not any(r.kind == "tune" for r in members):
            continue
        names = plan_labels(members)
        several_batches = len({M.batch_size(r) for r in members}) > 1
        labels = _unique(
            [
                r.metrics.get(K.TUNE_CANDIDATE)
                or names[r.run_id] + (f" · b{M.batch_size(r)}" if several_batches else "")
                for r in members
            ],
            members,
        )
        points = [
            ParetoPoint(
                label=label,
                throughput=M.known(M.throughput(r)),
                p99_ms=M.known(M.stat(r, "p99")),
                memory_mb=M.peak_memory_mb(r),
                run_id=r.run_id,
            )
            for label, r in zip(labels, members)
        ]
        with_mem = [i for i, p in enumerate(points) if p.memory_mb is not None]
        mem_front = pareto_front(
            [M.known(points[i].memory_mb) for i in with_mem], [points[i].throughput for i in with_mem]
        )
        head = members[0]
        workload = M.workload_label(head) if not several_batches else str(head.workload.get("scenario") or "")
        out.append(
            ParetoSet(
                title=f"{M.model_name(head)} · {head.kind} group {group} · {workload}",
                unit=M.throughput_unit(head),
                points=points,
                front_latency=pareto_front([p.p99_ms for p in points], [p.throughput for p in points]),
                front_memory=[with_mem[i] for i in mem_front],
            )
        )
    return out


# -- load curve (loadtest) ------------------------------------------------------------------------
# A find-max Result holds its sweep under `probes` (the load is each probe's `rate`); a single run
# is one level itself (several single runs of one model then make the curve), its load the
# `offered_rate`, or in closed loop the workload's `concurrency`. Latency is the request's
# `e2e_ms`; the load served `request_throughput`, the goodput `goodput_rate`.


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadPoint:
    load: float
    p50: float | None
    p90: float | None
    p99: float | None
    served: float | None  # requests/s answered
    goodput: float | None = None  # requests/s answered within the SLO


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadCurve:
    label: str
    load_name: str  # "rate", "offered_rate" or "concurrency"
    latency_name: str  # "e2e_ms"
    points: list[LoadPoint]  # by load
    slo_ms: float | None = None  # the objective on the plotted latency
    max_load: float | None = None  # the most load that met the SLO (find-max)


def load_point(level: dict[str, Any], load: Any) -> LoadPoint | None:
    """A probe or a single run at `load`; None when it lacks a load or a latency."""
    stats = level.get(K.E2E_MS)
    if M.number(load) is None or not M.is_stats(stats):
        return None
    return LoadPoint(
        load=float(load),
        p50=M.number(stats.get("p50")),
        p90=M.number(stats.get("p90")),
        p99=M.number(stats.get("p99")),
        served=M.number(level.get(K.REQUEST_THROUGHPUT)),
        goodput=M.number(level.get(K.GOODPUT_RATE)),
    )


def _single_run_load(result: Result) -> tuple[str, Any]:
    if result.metrics.get(K.OFFERED_RATE) is not None:
        return K.OFFERED_RATE, result.metrics[K.OFFERED_RATE]
    return K.CONCURRENCY, result.workload.get(K.CONCURRENCY)


def _slo_ms(result: Result) -> float | None:
    """The objective on the plotted latency: the workload's `slo` is in seconds by key."""
    slo = result.workload.get(K.SLO) or {}
    value = M.number(slo.get("e2e")) if isinstance(slo, dict) else None
    return value * 1000 if value is not None else None


def _curve(label: str, load_name: str, points: list[LoadPoint], result: Result) -> LoadCurve:
    return LoadCurve(
        label=label,
        load_name=load_name,
        latency_name=K.E2E_MS,
        points=sorted(points, key=lambda p: p.load),
        slo_ms=_slo_ms(result),
        max_load=M.number(result.metrics.get(K.MAX_RATE)),
    )


def load_curves(results: list[Result]) -> list[LoadCurve]:
    curves: list[LoadCurve] = []
    single: dict[tuple, list[Result]] = defaultdict(list)
    for r in results:
        if r.kind != "loadtest" or not r.ok:
            continue
        plan = "" if M.plan_name(r) == "-" else f" · {M.plan_name(r)}"
        probes = r.metrics.get(K.PROBES)
        if isinstance(probes, list):
            points = [p for p in (load_point(lv, lv.get(K.RATE)) for lv in probes if isinstance(lv, dict)) if p]
            if points:
                curves.append(_curve(f"{M.model_name(r)}{plan} · {r.run_id[:6]}", K.RATE, points, r))
        else:
            single[(r.group_id or "", M.model_name(r), plan, r.workload.get(K.ENDPOINT))].append(r)
    for (group, model, plan, _), members in single.items():
        named = [(name, load_point(m.metrics, load)) for m in members for name, load in [_single_run_load(m)]]
        points = [p for _, p in named if p]
        if len(points) >= 2:
            label = f"{model}{plan}" + (f" · group {group}" if group else "")
            curves.append(_curve(label, next(name for name, p in named if p), points, members[0]))
    return curves


# -- training curves ------------------------------------------------------------------------------
# The loss curve is `losses` (one number per optimizer step); the evaluations are `evals`, each
# at its optimizer `step`, with `accuracy` (classification) and the held-out `loss`.


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainCurve:
    label: str
    steps: list[float]
    losses: list[float]
    eval_x: list[float]  # optimizer step of each evaluation
    eval_x_name: str  # "optimizer step"
    eval_accuracy: list[float | None]
    eval_loss: list[float | None]


def _loss_points(raw: Any) -> tuple[list[float], list[float]]:
    if not isinstance(raw, list):
        return [], []
    points = [(float(step), float(loss)) for step, loss in enumerate(raw, 1) if M.number(loss) is not None]
    return [s for s, _ in points], [v for _, v in points]


def _evals(result: Result) -> list[dict[str, Any]]:
    raw = result.metrics.get(K.EVALS)
    return (
        [e for e in raw if isinstance(e, dict) and M.number(e.get(K.STEP)) is not None] if isinstance(raw, list) else []
    )


def final_accuracy(result: Result) -> float | None:
    return M.number(result.metrics.get(K.FINAL_ACCURACY))


def train_curves(results: list[Result]) -> list[TrainCurve]:
    trains = [r for r in results if r.kind == "train" and r.ok]
    labels = _unique([plan_labels(trains)[r.run_id] for r in trains], trains) if trains else []
    out = []
    for label, r in zip(labels, trains):
        steps, losses = _loss_points(r.metrics.get(K.LOSSES))
        evals = _evals(r)
        accuracy = [M.number(e.get(K.ACCURACY)) for e in evals]
        eval_loss = [M.number(e.get(K.LOSS)) for e in evals]
        if losses or any(a is not None for a in accuracy) or any(v is not None for v in eval_loss):
            out.append(
                TrainCurve(
                    label=f"{M.model_name(r)} · {label}",
                    steps=steps,
                    losses=losses,
                    eval_x=[float(e[K.STEP]) for e in evals],
                    eval_x_name="optimizer step",
                    eval_accuracy=accuracy,
                    eval_loss=eval_loss,
                )
            )
    return out
