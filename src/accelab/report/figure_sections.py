"""The report's figure sections: latency CDFs, throughput and memory against batch size, the tune
Pareto front, latency against load and training curves. Each hands a series from `series` to a
chart named in its Figure (drawn later by `plots`), with the table read beside it where there is
one; each returns None when its data is absent. Pure: no drawing, no files."""

from __future__ import annotations

from accelab.report import metrics as M, series as S
from accelab.report.document import Block, Figure, Section, Table, cell
from accelab.results import contract as K
from accelab.results.result import Result
from accelab.results.table import fmt


def latency_section(results: list[Result]) -> Section | None:
    panels = S.latency_panels(results)
    if not panels:
        return None
    blocks: list[Block] = []
    for i, panel in enumerate(panels, 1):
        raw = [c.from_samples for c in panel.curves]
        percentiles = "through the stored percentiles (min, p50, p90, p99, max)"
        how = (
            "every timed call"
            if all(raw)
            else f"dashed lines {percentiles}: these runs kept no per-call samples"
            if not any(raw)
            else f"solid lines: every timed call; dashed lines with markers: {percentiles} of runs that kept no "
            "per-call samples"
        )
        blocks.append(
            Figure(
                name=f"latency-{i}",
                chart="latency_cdf",
                data=panel,
                caption=f"{panel.title}: share of calls finished within a latency ({how}).",
                alt=f"Latency CDF of {len(panel.curves)} runs, {panel.title}",
            )
        )
    return Section(
        id="latency",
        title="Latency distribution",
        blocks=blocks,
        intro="Further left is faster; a steep curve is a steady one; the tail on the right is the p99.",
    )


def batch_section(results: list[Result], what: str) -> Section | None:
    panels = S.batch_panels(results, what)
    if not panels:
        return None
    noun = "Throughput" if what == "throughput" else "Memory"
    blocks: list[Block] = [
        Figure(
            name=f"{what}-batch-{i}",
            chart="batch_curve",
            data=p,
            caption=f"{p.title}: {p.ylabel} against batch size, one line per plan.",
            alt=f"{noun} against batch size, {p.title}",
        )
        for i, p in enumerate(panels, 1)
    ]
    return Section(id=f"{what}-batch", title=f"{noun} against batch size", blocks=blocks)


def pareto_table(ps: S.ParetoSet) -> Table:
    """Every trial, most throughput first, with the fronts it is on."""
    rows = []
    for i in sorted(range(len(ps.points)), key=lambda i: -ps.points[i].throughput):
        p = ps.points[i]
        fronts = [name for name, front in (("latency", ps.front_latency), ("memory", ps.front_memory)) if i in front]
        rows.append(
            [
                cell(p.label),
                cell(fmt(p.throughput)),
                cell(fmt(p.p99_ms)),
                cell(fmt(p.memory_mb)),
                cell(" + ".join(fronts) or "-", "good" if fronts else "muted"),
                cell(p.run_id, "id"),
            ]
        )
    return Table(
        columns=["plan", f"throughput ({ps.unit})", "p99 ms", "peak MB", "on the front of", "run"],
        rows=rows,
        numeric=frozenset({1, 2, 3}),
    )


def pareto_section(results: list[Result]) -> Section | None:
    sets = S.pareto_sets(results)
    if not sets:
        return None
    blocks: list = []
    for i, ps in enumerate(sets, 1):
        blocks.append(
            Figure(
                name=f"pareto-{i}",
                chart="pareto",
                data=ps,
                caption=f"{ps.title}: throughput against p99 latency and against peak memory; the line "
                "joins the plans no other plan beats on both axes.",
                alt=f"Pareto chart, {ps.title}",
            )
        )
        blocks.append(pareto_table(ps))
    return Section(
        id="pareto",
        title="Tuning trade-off (Pareto)",
        blocks=blocks,
        intro="Up and to the left is better: more throughput for less latency or memory.",
    )


def loadtest_section(results: list[Result]) -> Section | None:
    curves = S.load_curves(results)
    if not curves:
        return None
    blocks: list[Block] = [
        Figure(
            name=f"load-{i}",
            chart="load_curve",
            data=c,
            caption=f"{c.label}: {c.latency_name.removesuffix('_ms')} latency percentiles against "
            f"{c.load_name.replace('_', ' ')}"
            + (" (right axis: requests/s served and within the SLO)" if any(p.served for p in c.points) else "")
            + (f"; dotted line: the {fmt(c.slo_ms)} ms SLO" if c.slo_ms else "")
            + (f"; dash-dot line: the most load that met it, {fmt(c.max_load)}" if c.max_load else "")
            + ".",
            alt=f"Latency against load, {c.label}",
        )
        for i, c in enumerate(curves, 1)
    ]
    return Section(
        id="loadtest",
        title="Latency against load",
        blocks=blocks,
        intro="Where the p99 turns upward is the most load one replica holds.",
    )


def final_eval(result: Result) -> str:
    accuracy = S.final_accuracy(result)
    if accuracy is not None:
        return f"accuracy {accuracy:.2%}"
    perplexity = M.number(result.metrics.get(K.FINAL_PERPLEXITY))
    return f"perplexity {fmt(perplexity)}" if perplexity is not None else "-"


def training_section(results: list[Result]) -> Section | None:
    curves = S.train_curves(results)
    trains = [r for r in results if r.kind == "train"]
    if not curves and not trains:
        return None
    blocks: list = []
    if curves:
        blocks.append(
            Figure(
                name="training-1",
                chart="train_curves",
                data=curves,
                caption="Training loss per optimizer step and the evaluations, one line per run.",
                alt=f"Training curves of {len(curves)} runs",
            )
        )
    labels = S.plan_labels(trains)
    rows = [
        [
            cell(f"{M.model_name(r)} · {labels[r.run_id]}"),
            cell(r.status, "good" if r.ok else "bad"),
            cell(fmt(M.epoch_seconds(r)) + (" (est.)" if r.metrics.get(K.EPOCH_S_ESTIMATED) else "")),
            cell(fmt(M.throughput(r))),
            cell(fmt(M.peak_memory_mb(r))),
            cell(final_eval(r)),
            cell(r.run_id, "id"),
        ]
        for r in trains
    ]
    blocks.append(
        Table(
            columns=["run", "status", "epoch s", "samples/s", "peak MB", "final eval", "run id"],
            rows=rows,
            numeric=frozenset({2, 3, 4, 5}),
        )
    )
    return Section(id="training", title="Training curves", blocks=blocks)
