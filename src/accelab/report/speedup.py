"""The speed-up and quality section: which run of a (model, workload) group is its reference, each
row's speed-up over it (the paired interval when the two were measured side by side in one
compare, else the plain throughput ratio, marked), and the best speed-up the summary puts on a
card. Pure: no drawing, no files."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from accelab.report import metrics as M, series as S
from accelab.report.document import Section, Table, Tone, cell
from accelab.results import contract as K
from accelab.results.result import Result
from accelab.results.table import figure_text, fmt, noise_line, speedup_text, verdict_label

VERDICT_TONES: dict[str, Tone] = {
    "pass": "good",
    "warn": "warn",
    "fail": "bad",
    "cannot tell": "warn",
    "ok": "good",
    "improved": "good",
    "noise": "muted",
    "unreliable": "warn",
    "REGRESSION": "bad",
    "-": "muted",
}


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
        figures = ", ".join(f"{k}={figure_text(q, k)}" for k in (q.get("metrics") or {}))
        rows.append(
            [
                cell(f"{M.model_name(r)} · {labels[r.run_id]}"),
                cell(verdict_label(q), VERDICT_TONES.get(q.get("verdict") or "", "")),
                cell(figures or "-"),
                cell("; ".join(q.get("rules") or []) or "-", "muted"),
            ]
        )
    return Table(
        columns=["plan", "verdict", "fidelity against fp32 eager", "rules"],
        rows=rows,
        caption="Quality: outputs of each plan against the fp32 eager reference on the same real inputs "
        "(figures with their 95% intervals)",
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
