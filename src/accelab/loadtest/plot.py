"""Plots of a load test (matplotlib, Agg): latency CDF of one run, or latency and goodput
against offered load for a find-max search."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_cdf(latencies_ms: dict[str, list[float]], path: Path, *, title: str) -> Path:
    """One curve per series (e.g. e2e, ttft): the fraction of requests at or under each latency."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        for name, values in latencies_ms.items():
            if not values:
                continue
            ordered = sorted(values)
            ax.step(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], where="post", label=name)
        ax.set_xlabel("latency (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend()
        _save(fig, ax, path, title)
    finally:
        plt.close(fig)
    return path


def plot_find_max(probes: list[dict[str, Any]], path: Path, *, title: str, best_rate: float | None) -> Path:
    """p50/p99 latency (left axis, log) and goodput fraction (right axis) against offered rate."""
    plt = _pyplot()
    probes = sorted(probes, key=lambda p: p["rate"])
    rates = [p["rate"] for p in probes]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        for key, label, color in (("e2e_ms", "e2e", "tab:blue"), ("ttft_ms", "TTFT", "tab:orange")):
            for q, style in (("p50", "-o"), ("p99", "--o")):
                values = [(p.get(key) or {}).get(q) for p in probes]
                if any(v is not None for v in values):
                    ax.plot(
                        rates,
                        [v if v is not None else float("nan") for v in values],
                        style,
                        color=color,
                        label=f"{label} {q}",
                    )
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel("latency (ms)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        right = ax.twinx()
        right.plot(rates, [p.get("goodput_fraction") for p in probes], ":s", color="tab:green", label="goodput")
        right.set_ylabel("goodput (fraction meeting the SLO)")
        right.set_ylim(0, 1.05)
        if best_rate is not None:
            ax.axvline(best_rate, color="tab:red", alpha=0.4, label=f"max {best_rate:.3g} req/s")
        lines = ax.get_legend_handles_labels()
        more = right.get_legend_handles_labels()
        ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="upper left")
        _save(fig, ax, path, title)
    finally:
        plt.close(fig)
    return path


def _save(fig: Any, ax: Any, path: Path, title: str) -> None:
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
