"""`accelab history`, `accelab report`, `accelab regress`: thin commands over the results store."""

from __future__ import annotations

import datetime as dt
import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:  # heavy or report-only imports stay out of `accelab --help`
    from rich.console import Console

    from accelab.report.regress import Comparison, Thresholds

log = logging.getLogger(__name__)

REF_HELP = "A run id (or prefix), a tag (the newest run per model/plan/workload with it), or a JSON file from --json."
DB_HELP = "Results store (SQLite); default in the cache dir."
REGRESS_EPILOG = """\
Rule: a metric regresses only when it moves the bad way by more than BOTH its threshold and the
noise of the two runs (2 x the combined per-call spread; the p99 uses the tail width). Quality
pass -> warn/fail, or a candidate that failed to run, is a regression. Exit 1 on a regression.

In CI (same runner for both, so the machine fingerprints match):

  accelab bench minilm-l6 -b 8 --tag main-$BASE_SHA     # target branch
  accelab bench minilm-l6 -b 8 --tag pr-$SHA            # the change
  accelab regress --baseline main-$BASE_SHA --candidate pr-$SHA --threshold 5%

A tag on `accelab compare` names a whole group: regress then checks it plan by plan.
"""


def register(app: typer.Typer) -> None:
    app.command("history")(history_command)
    app.command("report")(report_command)
    app.command("regress", epilog=REGRESS_EPILOG)(regress_command)


def history_command(
    model: str | None = typer.Argument(None, help="Only runs of this model (the name it was run with)."),
    since: str | None = typer.Option(None, help="Only runs since a date (2026-11-01) or an age (30m, 12h, 7d, 2w)."),
    kind: str | None = typer.Option(None, help="bench | compare | verify | tune | train | loadtest | ..."),
    tag: str | None = typer.Option(None, help="Only runs with this tag."),
    group: str | None = typer.Option(None, help="Only runs of this compare / tune group."),
    limit: int = typer.Option(50, help="At most this many runs, newest first (0: all)."),
    csv_out: Path | None = typer.Option(None, "--csv", help="Also write the rows as CSV."),
    json_out: Path | None = typer.Option(
        None, "--json", help="Also write rows and full Results as JSON (a REF for regress)."
    ),
    db: Path | None = typer.Option(None, help=DB_HELP),
) -> None:
    """The runs in the results store: id, kind, model, plan, workload, status, key metric, machine."""
    from rich.console import Console

    from accelab.report import history
    from accelab.results.store import open_store

    store = open_store(db)
    since_iso = history.parse_since(since) if since else None
    results = store.query(model=model, kind=kind, tag=tag, group_id=group, since=since_iso, limit=limit or None)
    console = Console()
    filters = ", ".join(
        f"{k}={v}" for k, v in (("model", model), ("since", since), ("kind", kind), ("tag", tag), ("group", group)) if v
    )
    if not results:
        console.print(f"no runs in {store.path}" + (f" matching {filters}" if filters else ""))
    else:
        history.render(
            results,
            title=f"accelab history · {len(results)} of {store.count()} runs" + (f" · {filters}" if filters else ""),
            console=console,
        )
    if csv_out:
        csv_out.write_text(history.to_csv(results))
    if json_out:
        json_out.write_text(history.to_json(results))


def report_command(
    out: Path = typer.Option(..., "--out", "-o", help=".html: one self-contained file; .md: markdown, PNGs beside it."),
    run: list[str] = typer.Option([], "--run", help=f"Include these runs (repeatable). {REF_HELP}"),
    last: int | None = typer.Option(
        None, "--last", help="Include the newest N runs (default 10 when nothing else is chosen)."
    ),
    group: str | None = typer.Option(None, "--group", help="Include every run of this compare / tune group."),
    compare: tuple[str, str] | None = typer.Option(
        None, "--compare", help="BASELINE CANDIDATE refs: adds the regress tables."
    ),
    model: str | None = typer.Option(None, help="With --last: only runs of this model."),
    title: str | None = typer.Option(None, help="Report title."),
    threshold: str = typer.Option("5%", help="With --compare: latency / throughput threshold."),
    memory_threshold: str = typer.Option("10%", "--memory-threshold", help="With --compare: peak memory threshold."),
    allow_different_machines: bool = typer.Option(False, "--allow-different-machines", help="With --compare."),
    db: Path | None = typer.Option(None, help=DB_HELP),
) -> None:
    """A report with plots: environment, latency distributions, throughput and memory against batch
    size, the tune Pareto chart, load curves, training curves, speed-up and quality tables."""
    from accelab.report import regress
    from accelab.report.refs import load_ref
    from accelab.results.store import open_store

    store = open_store(db)
    chosen = [r for ref in run for r in load_ref(ref, store)]
    if group:
        chosen += store.query(group_id=group)
    comparison = None
    if compare and compare[0] and compare[1]:
        base, cand = load_ref(compare[0], store), load_ref(compare[1], store)
        thresholds = _thresholds(threshold, memory_threshold, 2.0)
        comparison = regress.compare(base, cand, thresholds, allow_different_machines=allow_different_machines)
        chosen += base + cand
    if last or not chosen:
        chosen += store.query(model=model, limit=last or 10)
    unique = list({r.run_id: r for r in chosen}.values())
    if not unique:
        raise ValueError(f"no runs to report in {store.path}; run `accelab bench` first, or pass --db")
    _write(unique, out, title=title, comparison=comparison)


def _write(runs: list, out: Path, *, title: str | None, comparison: Any) -> None:
    """The report of `runs` written to `out`, and a line that says what it holds."""
    from accelab.report.build import build_document
    from accelab.report.plots import draw
    from accelab.report.render import write_report

    generated = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    doc = build_document(runs, title=title, comparison=comparison, generated=generated)
    written = write_report(doc, out, draw)
    size_kb = sum(p.stat().st_size for p in written) / 1024
    typer.echo(
        f"wrote {out} ({len(runs)} runs, {len(doc.figures())} figures, {size_kb:,.0f} KB"
        + (f", {len(written) - 1} PNGs beside it" if len(written) > 1 else "")
        + ")"
    )
    if doc.skipped:
        typer.echo("not in this report: " + "; ".join(doc.skipped))


def regress_command(
    baseline: str = typer.Option(..., "--baseline", help=REF_HELP),
    candidate: str = typer.Option(..., "--candidate", help=REF_HELP),
    threshold: str = typer.Option(
        "5%", help="Latency (p50, p99, TTFT, TPOT) and throughput move tolerated, beyond noise."
    ),
    memory_threshold: str = typer.Option("10%", "--memory-threshold", help="Peak memory growth tolerated."),
    noise_factor: float = typer.Option(2.0, "--noise-factor", help="Noise limit = this x the runs' combined spread."),
    allow_different_machines: bool = typer.Option(
        False, "--allow-different-machines", help="Compare runs with different machine fingerprints (with a warning)."
    ),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the comparison as JSON."),
    db: Path | None = typer.Option(None, help=DB_HELP),
) -> None:
    """Regression gate: compare a candidate against a baseline, like with like; exit 1 on a regression."""
    from rich.console import Console

    from accelab.report import regress
    from accelab.report.refs import load_ref
    from accelab.results.store import open_store

    store = open_store(db)
    thresholds = _thresholds(threshold, memory_threshold, noise_factor)
    comparison = regress.compare(
        load_ref(baseline, store),
        load_ref(candidate, store),
        thresholds,
        allow_different_machines=allow_different_machines,
    )
    console = Console()
    print_comparison(comparison, console)
    if json_out:
        doc = {"regressed": comparison.regressed, **asdict(comparison)}
        json_out.write_text(json.dumps(doc, indent=2, default=str))
    if comparison.compared == 0:
        raise ValueError(
            "nothing was compared: the baseline runs did not measure anything the candidate did "
            "(see the warnings above)"
        )
    if comparison.regressed:
        raise typer.Exit(1)


def _thresholds(threshold: str, memory_threshold: str, noise_factor: float) -> Thresholds:
    from accelab.report.regress import Thresholds
    from accelab.units import parse_percent

    latency = parse_percent(threshold, "--threshold")
    return Thresholds(
        latency=latency,
        throughput=latency,
        memory=parse_percent(memory_threshold, "--memory-threshold"),
        noise_factor=noise_factor,
    )


def _value(value: float | str | None, unit: str) -> str:
    from accelab.results.table import fmt

    if value is None:
        return "-"
    text = fmt(value) if isinstance(value, float) else str(value)
    return f"{text} {unit}" if unit else text


def print_comparison(comparison: Comparison, console: Console) -> None:
    """The regress table per pair: metric | baseline | candidate | change | limit | verdict | why."""
    from rich.table import Table

    colours = {
        "ok": "green",
        "improved": "green",
        "noise": "dim",
        "unreliable": "yellow",
        "REGRESSION": "bold red",
        "-": "dim",
    }
    for warning in comparison.warnings:
        console.print(f"[yellow]{warning}[/]")
    for pair in comparison.pairs:
        table = Table(
            title=f"accelab regress · {pair.label} · {pair.baseline_id} → {pair.candidate_id}", title_justify="left"
        )
        for name in ("metric", "baseline", "candidate", "change", "limit", "verdict", "why"):
            table.add_column(name, justify="right" if name in ("baseline", "candidate", "change", "limit") else "left")
        for c in pair.checks:
            table.add_row(
                c.metric,
                _value(c.baseline, c.unit),
                _value(c.candidate, c.unit),
                "-" if c.change is None else f"{c.change * 100:+.1f}%",
                "-" if c.limit is None else f"±{c.limit * 100:.1f}%",
                f"[{colours.get(c.verdict, 'white')}]{c.verdict}[/]",
                c.why,
            )
        console.print(table)
        for warning in pair.warnings:
            console.print(f"[yellow]{warning}[/]")
    if comparison.regressed:
        bad = sum(p.regressed for p in comparison.pairs)
        console.print(
            f"[bold red]REGRESSION[/] in {bad} of {len(comparison.pairs)} pair(s): beyond both the "
            "threshold and the noise of the runs"
        )
    else:
        console.print(f"[green]no regression[/] in {len(comparison.pairs)} pair(s)")
