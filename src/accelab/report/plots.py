"""Report figures as PNG bytes. matplotlib's Agg canvas is used directly (no pyplot, no backend
switch): nothing global changes, except rcParams inside `rc_context`, which restores them.

`draw(figure)` dispatches on the figure's chart kind; every chart takes the series objects of
`accelab.report.series` and nothing else.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure as MplFigure
from matplotlib.ticker import FuncFormatter, MaxNLocator, PercentFormatter

from accelab.report.document import ChartKind, Figure
from accelab.report.series import BatchPanel, LatencyPanel, LoadCurve, ParetoSet, TrainCurve

if TYPE_CHECKING:
    from matplotlib.typing import RcKeyType

PALETTE = ["#2563eb", "#ea580c", "#16a34a", "#dc2626", "#9333ea", "#0891b2", "#ca8a04", "#db2777", "#4b5563", "#65a30d"]
DPI = 110
STYLE: dict[RcKeyType, Any] = {
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.titleweight": "bold",
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.color": "#e5e7eb",
    "grid.linewidth": 0.8,
    "axes.edgecolor": "#9ca3af",
    "axes.labelcolor": "#374151",
    "xtick.color": "#4b5563",
    "ytick.color": "#4b5563",
    "legend.frameon": False,
    "legend.fontsize": 9,
    "svg.fonttype": "none",
}


def colour(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def to_png(fig: MplFigure) -> bytes:
    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, bbox_inches="tight", facecolor="white", metadata={"Software": None})
    return buffer.getvalue()


def _legend(ax: Any, lines: int, inside: str = "best") -> None:
    """Inside the axes for a few lines; outside on the right when more would cover the data."""
    if lines > 3:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    else:
        ax.legend(loc=inside)


def _short(value: float) -> str:
    if value >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}"


# -- latency CDF -------------------------------------------------------------------------------
def latency_cdf(panel: LatencyPanel) -> MplFigure:
    fig = MplFigure(figsize=(9, 4.2))
    ax = fig.add_subplot()
    for i, curve in enumerate(panel.curves):
        if curve.from_samples:
            ax.step(curve.xs, curve.ys, where="post", color=colour(i), linewidth=2, label=curve.label)
        else:
            ax.plot(
                curve.xs,
                curve.ys,
                color=colour(i),
                linewidth=1.8,
                linestyle="--",
                marker="o",
                markersize=5,
                label=f"{curve.label} (percentiles)",
            )
        p50 = curve.stats.get("p50")
        if p50 is not None:
            ax.annotate(
                f"p50 {_short(p50)}",
                (p50, 0.5),
                xytext=(6, -12 - 11 * i),
                textcoords="offset points",
                fontsize=8,
                color=colour(i),
            )
    for q in (0.5, 0.9, 0.99):
        ax.axhline(q, color="#9ca3af", linewidth=0.7, linestyle=":")
    xs = [x for c in panel.curves for x in c.xs if x > 0]
    if xs and max(xs) / min(xs) > 20:
        ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xlabel("latency per call (ms)")
    ax.set_ylabel("calls finished")
    ax.set_title(panel.title, loc="left")
    _legend(ax, len(panel.curves), "lower right")
    return fig


# -- batch curves ------------------------------------------------------------------------------
def batch_curve(panel: BatchPanel) -> MplFigure:
    fig = MplFigure(figsize=(9, 4))
    ax = fig.add_subplot()
    batches = sorted({b for line in panel.lines for b, _ in line.points})
    for i, line in enumerate(panel.lines):
        xs, ys = [b for b, _ in line.points], [v for _, v in line.points]
        ax.plot(xs, ys, color=colour(i), marker="o", linewidth=2, markersize=6, label=line.label)
        for x, y in line.points:
            ax.annotate(
                _short(y), (x, y), xytext=(0, 7), textcoords="offset points", ha="center", fontsize=8, color=colour(i)
            )
    if batches and batches[-1] / max(batches[0], 1) >= 8:
        ax.set_xscale("log", base=2)
    ax.set_xticks(batches)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_ylim(bottom=0)
    ax.margins(y=0.15)
    ax.set_xlabel("batch size")
    ax.set_ylabel(panel.ylabel)
    ax.set_title(panel.title, loc="left")
    _legend(ax, len(panel.lines))
    return fig


# -- Pareto ------------------------------------------------------------------------------------
def _pareto_axis(ax: Any, xs: list[float], ys: list[float], labels: list[str], front: list[int], xlabel: str) -> None:
    ax.scatter(xs, ys, s=36, color="#cbd5e1", edgecolor="#64748b", zorder=2, label="plans tried")
    fx, fy = [xs[i] for i in front], [ys[i] for i in front]
    ax.plot(fx, fy, color=colour(0), linewidth=2, marker="o", markersize=7, zorder=3, label="Pareto front")
    shown = range(len(xs)) if len(xs) <= 12 else front
    for i in shown:
        ax.annotate(
            labels[i],
            (xs[i], ys[i]),
            xytext=(5, 4),
            textcoords="offset points",
            fontsize=8,
            color=colour(0) if i in front else "#475569",
        )
    ax.set_xlabel(xlabel)
    ax.margins(0.12)


def pareto(ps: ParetoSet) -> MplFigure:
    with_mem = [i for i, p in enumerate(ps.points) if p.memory_mb is not None]
    fig = MplFigure(figsize=(11, 4.4))
    axes = fig.subplots(1, 2 if with_mem else 1, squeeze=False)[0]
    labels = [p.label for p in ps.points]
    tps = [p.throughput for p in ps.points]
    _pareto_axis(axes[0], [p.p99_ms for p in ps.points], tps, labels, ps.front_latency, "p99 latency (ms)")
    axes[0].set_ylabel(f"throughput ({ps.unit})")
    axes[0].set_title("throughput against p99 latency", loc="left")
    axes[0].legend(loc="upper left")  # the front rises to the right: this corner is free
    if with_mem:
        mem_index = {i: k for k, i in enumerate(with_mem)}
        _pareto_axis(
            axes[1],
            [m for i in with_mem if (m := ps.points[i].memory_mb) is not None],
            [tps[i] for i in with_mem],
            [labels[i] for i in with_mem],
            [mem_index[i] for i in ps.front_memory],
            "peak memory (MB)",
        )
        axes[1].set_title("throughput against peak memory", loc="left")
    fig.suptitle(ps.title, x=0.01, ha="left", fontweight="bold")
    return fig


# -- load curve --------------------------------------------------------------------------------
def load_curve(curve: LoadCurve) -> MplFigure:
    """Latency percentiles against load, the SLO and the most load under it; on a right axis, the
    requests/s served and within the SLO when the run recorded them."""
    fig = MplFigure(figsize=(9, 4.2))
    ax = fig.add_subplot()
    xs = [p.load for p in curve.points]
    latency = {"e2e_ms": "e2e", "ttft_ms": "TTFT", "tpot_ms": "TPOT"}.get(curve.latency_name, "")
    for i, (name, pick) in enumerate((("p50", lambda p: p.p50), ("p90", lambda p: p.p90), ("p99", lambda p: p.p99))):
        ys = [pick(p) for p in curve.points]
        if any(y is not None for y in ys):
            ax.plot(
                xs,
                [math.nan if y is None else y for y in ys],
                marker="o",
                linewidth=2,
                color=colour(i),
                label=f"{latency} {name}".strip(),
            )
    if curve.slo_ms:
        ax.axhline(curve.slo_ms, color="#dc2626", linestyle=":", linewidth=1.5, label=f"SLO {_short(curve.slo_ms)} ms")
    if curve.max_load:
        ax.axvline(
            curve.max_load,
            color="#16a34a",
            linestyle="-.",
            linewidth=1.2,
            label=f"max under SLO: {_short(curve.max_load)}",
        )
    ax.set_xlabel(curve.load_name.replace("_", " ") + (" (req/s offered)" if "rate" in curve.load_name else ""))
    ax.set_ylabel(f"{latency} latency (ms)".strip())
    ax.set_ylim(bottom=0)
    handles, labels = ax.get_legend_handles_labels()
    h2, l2 = _rates_axis(ax, curve)
    ax.legend(handles + h2, labels + l2, loc="upper left", bbox_to_anchor=(1.08, 1.0), borderaxespad=0)
    ax.set_title(curve.label, loc="left")
    return fig


def _rates_axis(ax: Any, curve: LoadCurve) -> tuple[list, list[str]]:
    """The requests/s served and within the SLO on a right axis; its legend's (handles, labels),
    empty when the run recorded neither."""
    rates = [("served", [p.served for p in curve.points], "s"), ("goodput", [p.goodput for p in curve.points], "^")]
    if not any(v is not None for _, values, _ in rates for v in values):
        return [], []
    xs = [p.load for p in curve.points]
    twin = ax.twinx()
    twin.grid(False)
    for name, values, marker in rates:
        if any(v is not None for v in values):
            twin.plot(
                xs,
                [math.nan if v is None else v for v in values],
                color="#6b7280" if name == "served" else "#0891b2",
                linestyle="--",
                marker=marker,
                markersize=4,
                label=f"{name} (req/s)",
            )
    twin.set_ylabel("requests/s")
    twin.set_ylim(bottom=0)
    return twin.get_legend_handles_labels()


# -- training ----------------------------------------------------------------------------------
def train_curves(curves: list[TrainCurve]) -> MplFigure:
    has_loss = any(c.losses for c in curves)
    has_acc = any(a is not None for c in curves for a in c.eval_accuracy)
    has_eval = any(v is not None for c in curves for v in c.eval_loss)
    panels = [p for p, present in (("loss", has_loss), ("acc", has_acc), ("eval", has_eval and not has_acc)) if present]
    fig = MplFigure(figsize=(5.5 * len(panels), 4))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    eval_x_name = next((c.eval_x_name for c in curves if c.eval_x), "epoch")
    for ax, panel in zip(axes, panels):
        for i, c in enumerate(curves):
            if panel == "loss" and c.losses:
                ax.plot(c.steps, c.losses, color=colour(i), linewidth=1.6, label=c.label)
            values = c.eval_accuracy if panel == "acc" else c.eval_loss if panel == "eval" else []
            points = [(x, v) for x, v in zip(c.eval_x, values) if v is not None]
            if points:
                ax.plot(*zip(*points), color=colour(i), marker="o", linewidth=2, label=c.label)
        ax.set_xlabel("optimizer step" if panel == "loss" else eval_x_name)
        ax.set_ylabel({"loss": "training loss", "acc": "eval accuracy", "eval": "eval loss"}[panel])
        ax.set_title({"loss": "training loss per step", "acc": "eval accuracy", "eval": "eval loss"}[panel], loc="left")
        if panel == "acc":
            ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        if panel != "loss" and eval_x_name == "epoch":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        _legend(ax, len(curves))
    return fig


CHARTS: dict[ChartKind, Callable[[Any], MplFigure]] = {
    "latency_cdf": latency_cdf,
    "batch_curve": batch_curve,
    "pareto": pareto,
    "load_curve": load_curve,
    "train_curves": train_curves,
}


def draw(figure: Figure) -> bytes:
    """The figure as PNG bytes."""
    with matplotlib.rc_context(STYLE):
        return to_png(CHARTS[figure.chart](figure.data))
