"""The serving tune's output: a table per load level (every candidate with why it lost), the
winner's Plan file with its header, the JSON summary; `tune_serve` runs the tune
(`accelab.tuner.serving`) and writes them."""

from __future__ import annotations

import json
import statistics
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from accelab.results import contract as K
from accelab.results.table import make_console
from accelab.tuner.serve_window import _fmt, _p99
from accelab.tuner.serving import ServeTuneOutcome, ServeTuneRequest, run_serve_tune


def render(outcome: ServeTuneOutcome, request: ServeTuneRequest, console: Console) -> None:
    for ranking in outcome.rankings:
        users = ranking.users
        table = Table(
            title=f"{request.spec.name}: {users} user{'s' if users > 1 else ''}, SLO {request.slo.describe()}",
            title_justify="left",
        )
        for column in (
            "plan",
            "goodput tok/s",
            "tok/s",
            "TTFT p99 ms",
            "ITL p99 ms",
            "errors",
            "peak MiB",
            "quality",
            "steal",
            "verdict",
        ):
            table.add_column(column, overflow="fold")
        for key in ranking.order:
            c = outcome.candidates[key]
            rows = c.rows(users)
            steals = [(w.get(K.NOISE) or {}).get("steal") for w in rows]
            steal = max((s for s in steals if s is not None), default=None)
            verdict = "[bold green]winner[/]" if key == ranking.winner else escape(ranking.why.get(key, ""))
            table.add_row(
                escape(key),
                _fmt(c.median(users, K.GOODPUT_TOKEN_THROUGHPUT), 1),
                _fmt(c.median(users, K.OUTPUT_TOKEN_THROUGHPUT), 1),
                _fmt(_median([_p99(w, K.TTFT_MS) for w in rows])),
                _fmt(_median([_p99(w, K.ITL_MS) for w in rows]), 1),
                str(sum(w[K.ERRORS] for w in rows)) if rows else "-",
                _fmt(c.peak_rss_mb),
                c.quality or "-",
                "-" if steal is None else f"{100 * steal:.1f}% max",
                verdict,
            )
        console.print(table)
    for key, why in outcome.pruned.items():
        console.print(f"  not measured: {escape(key)}: {escape(why)}")
    if len(outcome.rankings) > 1:
        winners = "; ".join(f"{r.users} users: {r.winner or 'none'}" for r in outcome.rankings)
        console.print(f"winners: {escape(winners)}")


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def plan_header(outcome: ServeTuneOutcome, request: ServeTuneRequest, command: str) -> str:
    top = outcome.rankings[-1]
    assert top.winner is not None
    c = outcome.candidates[top.winner]
    lines = [
        f"{command} (tune id {outcome.group})",
        f"winner at {top.users} users: {top.winner}: "
        f"goodput {_fmt(c.median(top.users, K.GOODPUT_TOKEN_THROUGHPUT), 1)} "
        f"tokens/s, {_fmt(c.median(top.users, K.OUTPUT_TOKEN_THROUGHPUT), 1)} tokens/s, SLO {request.slo.describe()}, "
        f"peak {_fmt(c.peak_rss_mb)} MiB, quality {c.quality or 'not checked'}",
    ]
    if top.tie_with:
        lines.append(f"a tie with {top.tie_with}: {outcome.rankings[-1].why[top.tie_with]}")
    lines += [f"at {r.users} users the winner is {r.winner or 'none'}" for r in outcome.rankings[:-1]]
    lines.append(f"serve it: accelab serve {request.model} --plan {request.out}")
    return "\n".join(lines)


def summary_json(outcome: ServeTuneOutcome) -> dict[str, Any]:
    return {
        "tune_id": outcome.group,
        "levels": [
            {"users": r.users, "winner": r.winner, "tie_with": r.tie_with, "order": r.order, "why": r.why}
            for r in outcome.rankings
        ],
        "candidates": {
            key: {
                "quality": c.quality,
                "quality_detail": c.quality_detail,
                "peak_rss_mb": c.peak_rss_mb,
                "excluded": c.excluded,
                "goodput_tokens_per_s": {u: c.median(u, K.GOODPUT_TOKEN_THROUGHPUT) for u in c.windows},
                "tokens_per_s": {u: c.median(u, K.OUTPUT_TOKEN_THROUGHPUT) for u in c.windows},
            }
            for key, c in outcome.candidates.items()
        },
        "pruned": outcome.pruned,
        "reused_windows": outcome.reused,
        "plan": outcome.plan.to_dict() if outcome.plan else None,
    }


def tune_serve(request: ServeTuneRequest, console: Console | None = None, command: str = "") -> ServeTuneOutcome:
    """Measure, print the tables, write the winner's Plan (with its server settings) and the JSON."""
    console = console or make_console()
    outcome = run_serve_tune(request, console)
    render(outcome, request, console)
    if request.json_out:
        request.json_out.write_text(json.dumps(summary_json(outcome), indent=2, default=str))
    if outcome.plan is None:
        console.print("[bold red]no candidate met every limit: see why each lost above[/]")
        return outcome
    if request.out:
        header = plan_header(outcome, request, command or f"accelab tune {request.model} --scenario serve")
        request.out.write_text("".join(f"# {line}\n" for line in header.splitlines()) + outcome.plan.to_yaml())
        console.print(f"[bold green]best serving plan: {escape(str(outcome.rankings[-1].winner))}[/] -> {request.out}")
    return outcome
