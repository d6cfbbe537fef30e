"""Plot-ready series from Results: latency CDFs, batch-size curves, Pareto fronts, load curves and
training curves. Pure: no matplotlib, no I/O; every extractor returns [] when its data is absent,
so that a report section with nothing to draw is left out instead of drawing an empty chart.

Kinds still being written (train, loadtest, tune) are read tolerantly: the field names each one
accepts are listed next to its extractor.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from accelab.report import metrics as M
from accelab.results.result import Result

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
    pairs = [(stats.get(k), q) for k, q in (("min", 0.0), ("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0))]
    pairs = [(float(x), q) for x, q in pairs if M.number(x) is not None]
    return [x for x, _ in pairs], [q for _, q in pairs]


def latency_panels(results: list[Result]) -> list[LatencyPanel]:
    """One panel per (model, workload): every plan's latency CDF, from raw samples when stored."""
    measured = [r for r in results if r.ok and M.latency_stats(r) and r.kind != "tune"]  # tune: see pareto_sets
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
            curves.append(LatencyCurve(label=name, xs=xs, ys=ys, from_samples=bool(samples), stats=M.latency_stats(r) or {}))
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
    measured = [r for r in results if r.ok and M.latency_stats(r) and read(r) is not None and M.batch_size(r)
                and r.kind != "tune"]
    labels = plan_labels(measured)
    panels: dict[tuple, dict[tuple, dict[int, Result]]] = defaultdict(lambda: defaultdict(dict))
    for r in sorted(measured, key=lambda r: r.created):  # newest last, so it wins
        shape = tuple(v for k, v in zip(M.WORKLOAD_SHAPE, M.workload_key(r)) if k != "batch_size")
        panels[(M.model_name(r), shape)][plan_identity(r.plan)][M.batch_size(r)] = r
    out = []
    for (model, shape), lines in panels.items():
        drawn = []
        for by_batch in lines.values():
            first = next(iter(by_batch.values()))
            points = sorted((b, float(read(r))) for b, r in by_batch.items())
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


def pareto_sets(results: list[Result], min_points: int = 3) -> list[ParetoSet]:
    """One set per group (group_id) of a tune run, or of any group with `min_points` measured
    plans: the trade-off of throughput against p99 latency and against peak memory. A group may
    span batch sizes (a tuner tries several), so its title names the workload without the batch."""
    groups: dict[str, list[Result]] = defaultdict(list)
    for r in results:
        if r.group_id and r.ok and M.throughput(r) is not None and M.stat(r, "p99") is not None:
            groups[r.group_id].append(r)
    out = []
    for group, members in groups.items():
        if len(members) < min_points and not any(r.kind == "tune" for r in members):
            continue
        names = plan_labels(members)
        several_batches = len({M.batch_size(r) for r in members}) > 1
        labels = _unique([names[r.run_id] + (f" · b{M.batch_size(r)}" if several_batches else "") for r in members],
                         members)
        points = [
            ParetoPoint(label=label, throughput=float(M.throughput(r)), p99_ms=float(M.stat(r, "p99")),
                        memory_mb=M.peak_memory_mb(r), run_id=r.run_id)
            for label, r in zip(labels, members)
        ]
        with_mem = [i for i, p in enumerate(points) if p.memory_mb is not None]
        mem_front = pareto_front([points[i].memory_mb for i in with_mem], [points[i].throughput for i in with_mem])
        head = members[0]
        workload = M.workload_label(head) if not several_batches else str(head.workload.get("scenario") or "")
        out.append(ParetoSet(
            title=f"{M.model_name(head)} · {head.kind} group {group} · {workload}",
            unit=M.throughput_unit(head),
            points=points,
            front_latency=pareto_front([p.p99_ms for p in points], [p.throughput for p in points]),
            front_memory=[with_mem[i] for i in mem_front],
        ))
    return out


# -- load curve (loadtest) ------------------------------------------------------------------------
# A loadtest Result either holds its sweep as a list of levels under one of LEVEL_LISTS, or is one
# level itself (several Results of one group then make the curve). In a level, the load is the
# first of LOAD_KEYS present (in the level, then in the Result's workload); latency is a stats dict
# under one of LATENCY_KEYS or flat p50_ms / p90_ms / p99_ms; served load is one of SERVED_KEYS.
LEVEL_LISTS = ("levels", "steps", "sweep", "points", "rates")
LOAD_KEYS = ("offered_rps", "offered_rate", "rate", "target_rps", "request_rate", "concurrency", "users")
LATENCY_KEYS = ("latency_ms", "e2e_ms", "ttft_ms")
SERVED_KEYS = ("achieved_rps", "throughput_rps", "completed_rps", "goodput_rps", "throughput")


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadPoint:
    load: float
    p50: float | None
    p90: float | None
    p99: float | None
    served: float | None


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadCurve:
    label: str
    load_name: str  # "offered_rps", "concurrency", ...
    points: list[LoadPoint]  # by load
    slo_ms: float | None = None


def _first(data: dict[str, Any], keys: tuple[str, ...]) -> tuple[str | None, Any]:
    for key in keys:
        if data.get(key) is not None:
            return key, data[key]
    return None, None


def load_point(level: dict[str, Any], workload: dict[str, Any] | None = None) -> tuple[str, LoadPoint] | None:
    name, load = _first(level, LOAD_KEYS)
    if M.number(load) is None and workload:
        name, load = _first(workload, LOAD_KEYS)
    if M.number(load) is None:
        return None
    _, stats = _first(level, LATENCY_KEYS)
    stats = stats if M.is_stats(stats) else {q: level.get(f"{q}_ms") for q in ("p50", "p90", "p99")}
    _, served = _first(level, SERVED_KEYS)
    point = LoadPoint(load=float(load), p50=M.number(stats.get("p50")), p90=M.number(stats.get("p90")),
                      p99=M.number(stats.get("p99")), served=M.number(served))
    if point.p50 is None and point.p99 is None:
        return None
    return str(name), point


def load_curves(results: list[Result]) -> list[LoadCurve]:
    curves: list[LoadCurve] = []
    single: dict[tuple, list[Result]] = defaultdict(list)
    for r in results:
        if r.kind != "loadtest" or not r.ok:
            continue
        _, levels = _first(r.metrics, LEVEL_LISTS)
        if isinstance(levels, list):
            parsed = [p for p in (load_point(lv, r.workload) for lv in levels if isinstance(lv, dict)) if p]
            if parsed:
                curves.append(LoadCurve(label=f"{M.model_name(r)} · {M.plan_name(r)} · {r.run_id[:6]}",
                                        load_name=parsed[0][0], points=sorted((p for _, p in parsed), key=lambda p: p.load),
                                        slo_ms=_slo(r)))
        else:
            single[(r.group_id or "", M.model_name(r), M.plan_name(r))].append(r)
    for (group, model, plan), members in single.items():
        parsed = [p for p in (load_point(r.metrics, r.workload) for r in members) if p]
        if len(parsed) >= 2:
            curves.append(LoadCurve(label=f"{model} · {plan}" + (f" · group {group}" if group else ""),
                                    load_name=parsed[0][0], points=sorted((p for _, p in parsed), key=lambda p: p.load),
                                    slo_ms=_slo(members[0])))
    return curves


def _slo(result: Result) -> float | None:
    for source in (result.metrics, result.workload):
        for key in ("slo_ms", "slo_p99_ms", "p99_slo_ms"):
            if M.number(source.get(key)) is not None:
                return float(source[key])
    return None


# -- training curves ------------------------------------------------------------------------------
# The loss curve is the first of LOSS_KEYS present: a list of numbers (one per step), a list of
# {"step", "loss"} dicts, or {"step": [...], "loss": [...]}. Per-epoch records (EPOCH_KEYS) are
# dicts with any of epoch, loss / train_loss, eval_loss, accuracy / eval_accuracy, epoch_time_s.
LOSS_KEYS = ("loss_curve", "losses", "train_loss_curve", "loss_history", "step_losses", "history")
EPOCH_KEYS = ("epochs", "epoch_history", "per_epoch")
ACCURACY_KEYS = ("final_accuracy", "eval_accuracy", "accuracy", "top1", "final_top1")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainCurve:
    label: str
    steps: list[float]
    losses: list[float]
    epochs: list[float]
    epoch_accuracy: list[float | None]
    epoch_eval_loss: list[float | None]


def _loss_points(raw: Any) -> tuple[list[float], list[float]]:
    if isinstance(raw, dict) and isinstance(raw.get("loss"), list):
        losses = raw["loss"]
        steps = raw.get("step") or raw.get("steps") or list(range(1, len(losses) + 1))
        raw = [{"step": s, "loss": v} for s, v in zip(steps, losses)]
    if not isinstance(raw, list):
        return [], []
    steps, losses = [], []
    for i, item in enumerate(raw, 1):
        step, loss = (item.get("step", i), item.get("loss", item.get("train_loss"))) if isinstance(item, dict) else (i, item)
        if M.number(step) is not None and M.number(loss) is not None:
            steps.append(float(step))
            losses.append(float(loss))
    return steps, losses


def final_accuracy(result: Result) -> float | None:
    _, value = _first(result.metrics, ACCURACY_KEYS)
    if M.number(value) is not None:
        return float(value)
    _, epochs = _first(result.metrics, EPOCH_KEYS)
    if isinstance(epochs, list) and epochs and isinstance(epochs[-1], dict):
        _, value = _first(epochs[-1], ("accuracy", "eval_accuracy", "top1"))
        return M.number(value)
    return None


def train_curves(results: list[Result]) -> list[TrainCurve]:
    trains = [r for r in results if r.kind == "train" and r.ok]
    labels = _unique([plan_labels(trains)[r.run_id] for r in trains], trains) if trains else []
    out = []
    for label, r in zip(labels, trains):
        _, raw = _first(r.metrics, LOSS_KEYS)
        steps, losses = _loss_points(raw)
        _, epochs_raw = _first(r.metrics, EPOCH_KEYS)
        records = [e for e in epochs_raw if isinstance(e, dict)] if isinstance(epochs_raw, list) else []
        epochs = [float(e.get("epoch", i)) for i, e in enumerate(records, 1)]
        accuracy = [M.number(_first(e, ("accuracy", "eval_accuracy", "top1"))[1]) for e in records]
        eval_loss = [M.number(e.get("eval_loss")) for e in records]
        if losses or any(a is not None for a in accuracy) or any(v is not None for v in eval_loss):
            out.append(TrainCurve(label=f"{M.model_name(r)} · {label}", steps=steps, losses=losses, epochs=epochs,
                                  epoch_accuracy=accuracy, epoch_eval_loss=eval_loss))
    return out
