"""Results -> a report Document: one function per section, each returning None when its data is
absent (the document then lists it under "not in this report"). Pure: no drawing, no files."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

from accelab.report import metrics as M, series as S
from accelab.report.document import Block, Cards, Document, Facts, Figure, Note, Section, Table, Tone, cell
from accelab.report.history import short_time
from accelab.report.regress import Comparison, PairResult
from accelab.results import contract as K
from accelab.results.result import Result
from accelab.results.table import fmt, noise_line, speedup_text

VERDICT_TONES: dict[str, Tone] = {
    "pass": "good",
    "warn": "warn",
    "fail": "bad",
    "ok": "good",
    "improved": "good",
    "noise": "muted",
    "unreliable": "warn",
    "REGRESSION": "bad",
    "-": "muted",
}


def build_document(
    results: list[Result], *, title: str | None = None, comparison: Comparison | None = None, generated: str = ""
) -> Document:
    """The whole report; `comparison` (from `regress.compare`) adds a baseline-vs-candidate section."""
    results = sorted(results, key=lambda r: r.created)
    models = sorted({M.model_name(r) for r in results})
    doc = Document(
        title=title or f"accelab report · {', '.join(models[:3]) or 'no runs'}{' …' if len(models) > 3 else ''}",
        subtitle=f"{len(results)} run{'s' * (len(results) != 1)}" + (f" · generated {generated}" if generated else ""),
        sections=[],
    )
    # (section builder, what the report says when it has no data for it; None: always present)
    builders: list[tuple[Callable[[], Section | None], str | None]] = [
        # the headline first, then the figures; the machine and the run list are the appendix
        (lambda: summary_section(results), None),
        (lambda: regress_section(comparison) if comparison else None, None),
        (lambda: speedup_section(results), "Speed-up and quality: no measured runs"),
        (lambda: latency_section(results), "Latency distribution: no run with latency figures"),
        (
            lambda: batch_section(results, "throughput"),
            "Throughput against batch size: no plan measured at two batch sizes or more",
        ),
        (
            lambda: batch_section(results, "memory"),
            "Memory against batch size: no plan measured at two batch sizes or more",
        ),
        (lambda: pareto_section(results), "Tuning trade-off (Pareto): no tune group (or group of 3+ plans) selected"),
        (lambda: loadtest_section(results), "Latency against load: no loadtest runs with per-level latencies"),
        (lambda: training_section(results), "Training curves: no train runs selected"),
        (lambda: environment_section(results), None),
        (lambda: runs_section(results), None),
    ]
    for build, absent in builders:
        section = build()
        if section is not None:
            doc.sections.append(section)
        elif absent:
            doc.skipped.append(absent)
    if doc.skipped and doc.sections:
        doc.sections[0].blocks.append(Note(text="Not in this report — " + "; ".join(doc.skipped) + ".", tone="muted"))
    return doc


# -- summary -----------------------------------------------------------------------------------
def best_speedup(results: list[Result]) -> tuple[float, str] | None:
    """The largest speed-up over its reference of a plan that differs from the reference (a repeat
    of the reference plan is not a speed-up); None when no plan beat its reference."""
    best = None
    for members in measurement_groups(results).values():
        ref = _reference(members)
        if ref is None:
            continue
        labels = S.plan_labels(members)
        for r in members:
            tp = M.throughput(r) if r.ok else None
            if not tp or S.plan_identity(r.plan) == S.plan_identity(ref.plan) or _noise_level(r) == "unreliable":
                continue
            paired = _paired(r, ref)
            if paired is not None and paired.get("verdict") != "faster":
                continue  # its interval did not show it faster: not a speed-up to put on a card
            speedup = paired["value"] if paired is not None else tp / _rate(ref)
            if speedup > 1 and (best is None or speedup > best[0]):
                best = (speedup, f"{labels[r.run_id]} over {labels[ref.run_id]}, {M.model_name(r)}")
    return best


def summary_section(results: list[Result]) -> Section:
    ok = sum(r.ok for r in results)
    machines = {r.fingerprint for r in results if r.fingerprint}
    cards = [
        (str(len(results)), f"runs ({ok} ok)"),
        (str(len({M.model_name(r) for r in results})), "models"),
        (str(len(machines)), "machines" if len(machines) != 1 else "machine"),
    ]
    best = best_speedup(results)
    if best:
        cards.append((f"{best[0]:.2f}x", f"best speed-up: {best[1]}"))
    verdicts = [M.quality_verdict(r) for r in results if M.quality_verdict(r)]
    if verdicts:
        cards.append((f"{verdicts.count('pass')}/{len(verdicts)}", "quality checks passed"))
    blocks: list = [Cards(items=cards)]
    if len(machines) > 1:
        blocks.append(
            Note(
                tone="warn",
                text=f"{len(machines)} machines: results from different machines are not "
                "compared as equals (see Environment).",
            )
        )
    failed = [r for r in results if not r.ok]
    if failed:
        blocks.append(
            Note(
                tone="warn",
                text=f"{len(failed)} run(s) did not measure: "
                + "; ".join(f"{M.plan_name(r)} {r.status}" for r in failed[:6])
                + (" …" if len(failed) > 6 else ""),
            )
        )
    return Section(id="summary", title="Summary", blocks=blocks)


def runs_table(results: list[Result]) -> Table:
    rows = [
        [
            cell(r.run_id, "id"),
            cell(short_time(r.created)),
            cell(r.kind),
            cell(M.model_name(r)),
            cell(M.plan_name(r)),
            cell(M.workload_label(r)),
            cell(r.status, "good" if r.ok else "warn" if r.status == "unsupported" else "bad"),
            cell(M.key_metric(r)),
            cell(r.tag or ""),
            cell(r.fingerprint or "-", "id"),
        ]
        for r in results
    ]
    return Table(
        columns=["run", "created (UTC)", "kind", "model", "plan", "workload", "status", "key metric", "tag", "machine"],
        rows=rows,
    )


# -- regress -----------------------------------------------------------------------------------
def _signed(change: float | None) -> str:
    return "-" if change is None else f"{change * 100:+.1f}%"


def _value(value: float | str | None, unit: str) -> str:
    text = fmt(value) if isinstance(value, float) else cell(value).text
    return f"{text} {unit}".strip() if value is not None else "-"


def regress_table(pair: PairResult) -> Table:
    rows = []
    for c in pair.checks:
        rows.append(
            [
                cell(c.metric),
                cell(_value(c.baseline, c.unit)),
                cell(_value(c.candidate, c.unit)),
                cell(_signed(c.change)),
                cell("-" if c.limit is None else f"±{c.limit * 100:.1f}%"),
                cell(c.verdict, VERDICT_TONES.get(c.verdict, "")),
                cell(c.why, "muted"),
            ]
        )
    return Table(
        columns=["metric", "baseline", "candidate", "change", "limit", "verdict", "why"],
        rows=rows,
        caption=f"{pair.label}: {pair.baseline_id} → {pair.candidate_id}",
        numeric=frozenset({1, 2, 3, 4}),
    )


def regress_section(comparison: Comparison) -> Section:
    verdict = (
        "REGRESSION: the candidate is worse beyond threshold and noise"
        if comparison.regressed
        else "no regression beyond threshold and noise"
    )
    blocks: list = [Note(text=verdict, tone="bad" if comparison.regressed else "good")]
    blocks += [Note(text=w, tone="warn") for w in comparison.warnings]
    for pair in comparison.pairs:
        blocks += [Note(text=w, tone="warn") for w in pair.warnings]
        blocks.append(regress_table(pair))
    intro = (
        "A move counts as a regression only beyond both its threshold and the noise of the two runs "
        "(2 × their combined spread); see `accelab regress --help`."
    )
    return Section(id="regress", title="Baseline against candidate", intro=intro, blocks=blocks)


# -- environment -------------------------------------------------------------------------------
def environment_facts(env: dict, fingerprint: str, runs: int) -> Facts:
    versions = env.get("versions") or {}
    gpus = env.get("gpus") or []
    cpu = env.get("cpu") or {}
    items = [
        ("fingerprint", fingerprint or "-"),
        ("runs measured here", str(runs)),
        ("CPU", str(env.get("cpu_model") or "-")),
        (
            "cores",
            f"{env.get('physical_cores')} physical · {env.get('logical_cores')} logical · "
            f"{env.get('available_cores')} available",
        ),
        (
            "native bf16 / fp16",
            f"{cpu.get('native_bf16')} / {cpu.get('native_fp16')} "
            f"(torch dispatch {cpu.get('torch_capability') or '-'})",
        ),
        ("RAM", f"{(env.get('ram_total_bytes') or 0) / 2**30:.1f} GiB" if env.get("ram_total_bytes") else "-"),
        ("GPUs", ", ".join(str(g.get("name")) for g in gpus) or "none"),
        ("driver / CUDA", f"{env.get('driver_version') or '-'} / {env.get('cuda_version') or '-'}"),
        ("platform", str(env.get("platform") or "-")),
        ("host", str(env.get("hostname") or "-")),
        (
            "torch threads",
            f"{(env.get('torch_threads') or {}).get('intra_op')} intra-op · "
            f"{(env.get('torch_threads') or {}).get('inter_op')} inter-op",
        ),
    ]
    items += [(name, str(v)) for name, v in versions.items() if v]
    return Facts(title=f"machine {fingerprint or '(no fingerprint)'}", items=items)


def environment_section(results: list[Result]) -> Section | None:
    by_fp: dict[str, list[Result]] = defaultdict(list)
    unrecorded = []  # e.g. a loadtest measures a server, wherever it runs: no machine of its own
    for r in results:
        if r.fingerprint or r.environment:
            by_fp[r.fingerprint].append(r)
        else:
            unrecorded.append(r)
    if not by_fp and not unrecorded:
        return None
    blocks: list = []
    if len(by_fp) > 1:
        blocks.append(
            Note(
                tone="warn",
                text=f"{len(by_fp)} machines: results from different machines are not "
                "compared as equals; compare rows of one fingerprint only.",
            )
        )
    for fp, members in by_fp.items():
        env = next((r.environment for r in reversed(members) if r.environment), {})
        blocks.append(environment_facts(env, fp, len(members)))
    if unrecorded:
        kinds = ", ".join(sorted({f"{r.kind} {r.run_id}" for r in unrecorded}))
        blocks.append(
            Note(
                tone="muted",
                text=f"No machine recorded for {len(unrecorded)} run(s) ({kinds}): a load "
                "test measures a server, wherever that server runs.",
            )
        )
    return Section(
        id="environment",
        title="Environment",
        blocks=blocks,
        intro="The machine fingerprint hashes CPU model, core counts, GPUs, driver and the torch / "
        "transformers / accelerate versions: equal fingerprints, comparable numbers.",
    )


# -- speed-up and quality ----------------------------------------------------------------------
def measurement_groups(results: list[Result]) -> dict[tuple, list[Result]]:
    """(model, workload) -> the runs that measured that work (ok or not), oldest first."""
    groups: dict[tuple, list[Result]] = defaultdict(list)
    for r in results:
        # tune trials vary every field at once: they are read on the Pareto chart instead
        if r.workload.get("scenario") in ("forward", "generate") and r.kind not in ("loadtest", "verify", "tune"):
            groups[(M.model_name(r), M.workload_key(r))].append(r)
    return groups


def _reference(members: list[Result]) -> Result | None:
    ok = [r for r in members if r.ok and M.throughput(r)]
    return next((r for r in ok if M.plan_name(r) == "baseline"), ok[0] if ok else None)


def _rate(ref: Result) -> float:
    """A reference's throughput: `_reference` picks only runs that have one."""
    rate = M.throughput(ref)
    assert rate, f"the reference {ref.run_id} has no throughput"
    return rate


def _noise_level(r: Result) -> str | None:
    noise = r.metrics.get(K.NOISE)
    return noise.get("level") if isinstance(noise, dict) else None


def _paired(r: Result, ref: Result | None) -> dict | None:
    """The row's paired speed-up record when it was measured side by side with `ref` (same compare)."""
    record = r.metrics.get(K.SPEEDUP)
    if ref is None or not isinstance(record, dict) or r.group_id is None or r.group_id != ref.group_id:
        return None
    return record if record.get("reference") == M.plan_name(ref) else None


NOISE_TONES: dict[str, Tone] = {"quiet": "good", "noisy": "warn", "unreliable": "bad"}
SPEED_TONES: dict[str, Tone] = {"faster": "good", "slower": "bad"}


def _speed_cell(r: Result, ref: Result | None) -> Any:
    """The paired speed-up with its interval when there is one; else the plain throughput ratio,
    marked when the two runs were not measured side by side."""
    paired = _paired(r, ref)
    if paired is not None:
        tone = SPEED_TONES.get(paired.get("verdict") or "", "muted")
        return cell(
            speedup_text(paired.get("value"), paired.get("low"), paired.get("high"), paired.get("verdict")), tone
        )
    tp = M.throughput(r)
    speed = tp / _rate(ref) if ref and tp and r.ok else None
    if speed is None:
        return cell("-")
    # runs that measured noise know whether they ran side by side (same compare): say when not
    measured = _noise_level(r) is not None and ref is not None and _noise_level(ref) is not None
    apart = (
        " (not side by side)" if measured and ref is not None and r is not ref and r.group_id != ref.group_id else ""
    )
    return cell(f"{speed:.2f}x{apart}", "good" if speed > 1.05 else "bad" if speed < 0.95 else "")


def speedup_table(members: list[Result]) -> Table:
    ref = _reference(members)
    labels = S.plan_labels(members)
    rows = []
    for r in members:
        tp, mem = M.throughput(r), M.peak_memory_mb(r)
        ref_mem = M.peak_memory_mb(ref) if ref else None
        saved = 1 - mem / ref_mem if ref and mem and ref_mem and r.ok else None
        verdict = M.quality_verdict(r)
        note = "" if r.ok else f"{r.status}: {M.first_line(r.reason, 80)}"
        rows.append(
            [
                cell(labels[r.run_id] + (" (reference)" if r is ref else "")),
                cell(fmt(M.stat(r, "p50"))),
                cell(fmt(M.stat(r, "p99"))),
                cell(fmt(tp)),
                cell(fmt(mem)),
                _speed_cell(r, ref),
                cell("-" if saved is None else f"{saved * 100:+.0f}%"),
                cell(verdict or "-", VERDICT_TONES.get(verdict or "-", "")),
                cell(note or _noise_note(r) or "; ".join(r.notes)[:120], "muted"),
                cell(_noise_level(r) or "-", NOISE_TONES.get(_noise_level(r) or "", "muted")),
                cell(r.run_id, "id"),
            ]
        )
    head = members[0]
    unit = M.throughput_unit(ref or head)
    return Table(
        columns=[
            "plan",
            "p50 ms",
            "p99 ms",
            unit,
            "peak MB",
            "speed-up",
            "memory saved",
            "quality",
            "notes",
            "noise",
            "run",
        ],
        rows=rows,
        caption=f"{M.model_name(head)} · {M.workload_label(head)}",
        numeric=frozenset({1, 2, 3, 4, 5, 6}),
    )


def _noise_note(r: Result) -> str:
    noise = r.metrics.get(K.NOISE)
    if not isinstance(noise, dict) or noise.get("level") in (None, "quiet"):
        return ""
    return noise_line(noise, "row")[:160]


def quality_table(results: list[Result]) -> Table | None:
    judged = [r for r in results if r.quality]
    if not judged:
        return None
    labels = S.plan_labels(judged)
    rows = []
    for r in judged:
        q = r.quality or {}
        figures = ", ".join(
            f"{k}={fmt(v, 4) if isinstance(v, float) else v}" for k, v in (q.get("metrics") or {}).items()
        )
        rows.append(
            [
                cell(f"{M.model_name(r)} · {labels[r.run_id]}"),
                cell(q.get("verdict"), VERDICT_TONES.get(q.get("verdict") or "", "")),
                cell(figures or "-"),
                cell("; ".join(q.get("rules") or []) or "-", "muted"),
            ]
        )
    return Table(
        columns=["plan", "verdict", "fidelity against fp32 eager", "rules"],
        rows=rows,
        caption="Quality: outputs of each plan against the fp32 eager reference on the same real inputs",
    )


def speedup_section(results: list[Result]) -> Section | None:
    groups = measurement_groups(results)
    if not groups:
        return None
    blocks: list = [speedup_table(members) for members in groups.values()]
    quality = quality_table(results)
    if quality:
        blocks.append(quality)
    return Section(
        id="speedup",
        title="Speed-up and quality",
        blocks=blocks,
        intro="Speed-up is throughput over the reference row (the plan named baseline, else the first "
        "measured); memory saved is against the same row.",
    )


# -- plots -------------------------------------------------------------------------------------
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


# -- runs appendix -----------------------------------------------------------------------------
def runs_section(results: list[Result]) -> Section | None:
    if not results:
        return None
    rows = []
    for r in results:
        detail = "; ".join(filter(None, [M.first_line(r.reason, 200) if r.reason else "", *r.notes]))
        rows.append(
            [cell(r.run_id, "id"), cell(r.command or "-"), cell(detail or "-", "muted"), cell(r.group_id or "-", "id")]
        )
    return Section(
        id="runs",
        title="Runs",
        intro="Every run in this report, and the command that reproduces it.",
        blocks=[runs_table(results), Table(columns=["run", "command", "notes", "group"], rows=rows)],
    )
