"""What a tune prints and draws: every plan tried with why it lost, and the Pareto chart."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from accelab.results.table import fmt, make_console
from accelab.tuner.search import PHASE_RANK, Measurement, SearchLog


def best_by_candidate(log: SearchLog) -> dict[str, Measurement]:
    """The latest (longest) measurement of each candidate: a final overrides screening."""
    chosen: dict[str, Measurement] = {}
    for m in log.measurements:
        key = m.candidate.key
        if key not in chosen or PHASE_RANK[m.phase] >= PHASE_RANK[chosen[key].phase]:
            chosen[key] = m
    return chosen


def render(log: SearchLog, pruned: dict[str, str], unit: str, console: Console | None = None) -> None:
    console = console or make_console()
    table = Table(title="accelab tune · every plan tried", title_justify="left")
    for col in ("plan @ batch", "phase", f"throughput ({unit})", "p50 ms", "p99 ms", "peak MB", "quality", "verdict"):
        table.add_column(col, no_wrap=col != "verdict")
    chosen = best_by_candidate(log)
    order = sorted(chosen.values(), key=lambda m: (log.verdicts.get(m.candidate.key) != "winner", -(m.throughput or 0)))
    for m in order:
        verdict = log.verdicts.get(m.candidate.key, "")
        style = "bold green" if verdict == "winner" else "yellow" if verdict.startswith(("tie", "runner")) else ""
        table.add_row(
            escape(m.candidate.key),
            m.phase,
            fmt(m.throughput),
            fmt(m.p50_ms),
            fmt(m.p99_ms),
            fmt(m.memory_mb),
            m.quality or "-",
            f"[{style}]{escape(verdict)}[/]" if style else escape(verdict),
        )
    for name, why in pruned.items():
        table.add_row(escape(name), "-", "-", "-", "-", "-", "-", escape(f"not searched: {why}"))
    console.print(table)
    console.print(f"measurement time: {log.measured_seconds:.0f} s over {len(log.measurements)} runs", highlight=False)


def pareto_front(points: list[Measurement]) -> list[Measurement]:
    """Measurements no other beats on throughput, p99 latency and memory at once."""

    def dominated(a: Measurement, b: Measurement) -> bool:
        return (
            (b.throughput or 0) >= (a.throughput or 0)
            and (b.p99_ms or 0) <= (a.p99_ms or 0)
            and (b.memory_mb or 0) <= (a.memory_mb or 0)
            and (b.throughput, b.p99_ms, b.memory_mb) != (a.throughput, a.p99_ms, a.memory_mb)
        )

    return [a for a in points if not any(dominated(a, b) for b in points)]


def plot_pareto(log: SearchLog, path: Path, unit: str, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # measured points only: `or 0.0` below never applies, it only tells the types so
    points = [m for m in best_by_candidate(log).values() if m.status == "ok" and m.throughput and m.p99_ms]
    front = {m.candidate.key for m in pareto_front(points)}
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=110)
    if points:
        memory = [m.memory_mb or 0 for m in points]
        scatter = ax.scatter(
            [m.p99_ms or 0.0 for m in points],
            [m.throughput or 0.0 for m in points],
            c=memory,
            cmap="viridis",
            s=[90 if m.candidate.key in front else 40 for m in points],
            edgecolors=["black" if m.candidate.key in front else "none" for m in points],
        )
        fig.colorbar(scatter, ax=ax, label="peak memory (MB)")
        for m in points:
            ax.annotate(
                m.candidate.key, (m.p99_ms, m.throughput), fontsize=7, xytext=(4, 3), textcoords="offset points"
            )
        front_pts = sorted((m for m in points if m.candidate.key in front), key=lambda m: m.p99_ms or 0)
        ax.plot(
            [m.p99_ms or 0.0 for m in front_pts],
            [m.throughput or 0.0 for m in front_pts],
            "--",
            color="grey",
            lw=1,
            label="Pareto front",
        )
        ax.legend(loc="lower right")
    ax.set_xscale("log")
    ax.set_xlabel("p99 latency (ms, log scale)")
    ax.set_ylabel(f"throughput ({unit})")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
