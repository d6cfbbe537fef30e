"""Results -> a report Document, in reading order: the summary, the baseline-vs-candidate check,
the speed-up tables (`speedup`), the figures (`figure_sections`), then the appendix: the machines
and every run. Each section builder returns None when its data is absent (the document then lists
it under "not in this report"). Pure: no drawing, no files."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from accelab.report import metrics as M
from accelab.report.document import Cards, Document, Facts, Note, Section, Table, cell
from accelab.report.figure_sections import (
    batch_section,
    latency_section,
    loadtest_section,
    pareto_section,
    training_section,
)
from accelab.report.history import short_time
from accelab.report.regress import Comparison, PairResult
from accelab.report.speedup import VERDICT_TONES, best_speedup, speedup_section
from accelab.results.result import Result
from accelab.results.table import fmt


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
