"""The compare table: one row per plan, speed-up and memory against the first plan. Pure."""

from __future__ import annotations

import csv
import io
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from accelab.results.result import Result
from accelab.results.table import (
    VERDICT_COLOURS,
    fmt,
    make_console,
    noise_line,
    quality_headline,
    speedup_text,
    verdict_label,
)


def _status_note(result: Result, speedup: dict[str, Any], noise: dict[str, Any]) -> str:
    if result.status == "unsupported":
        return f"unsupported here: {result.reason}"
    if not result.ok:
        reason = (result.reason or "").splitlines()[0][:160] if result.reason else ""
        return reason if reason.startswith(f"{result.status}:") else f"{result.status}: {reason}"
    notes = list(result.notes)
    if result.quality and result.quality.get("verdict") == "cannot tell":
        needed = result.quality.get("samples_needed")
        notes.insert(
            0,
            f"quality {verdict_label(result.quality)} at this sample size; "
            + (f"about --samples {needed} would tell" if needed else "an estimate sits on a line"),
        )
    if noise and noise.get("level") != "quiet":
        notes.insert(0, noise_line(noise, "row"))
    if speedup.get("verdict") in ("unreliable", "no measurable difference"):
        reason = str(speedup["reason"])
        if speedup["verdict"] == "unreliable" and noise:
            reason = reason.split("; ")[0]  # the row's noise line below says what was loud
        notes.insert(0, f"speed-up {reason}")
    return "; ".join(notes)


def _speedup(result: Result, metrics: dict[str, Any], base_tp: float | None) -> dict[str, Any]:
    """The row's paired speed-up record (benchmark.rounds.speedup_record); for the reference row and
    for Results stored before rounds were paired, the plain throughput ratio without a verdict."""
    if isinstance(metrics.get("speedup"), dict):
        return metrics["speedup"]
    tp = metrics.get("throughput")
    return {"value": tp / base_tp if base_tp and tp else None}


def rows(results: list[Result]) -> list[dict[str, Any]]:
    """Plain rows (numbers, not strings) for JSON / CSV; speed-ups against the first ok row."""
    base = next((r for r in results if r.ok), None)
    base_tp = base.metrics.get("throughput") if base else None
    base_mem = base.metrics.get("peak_memory_mb") if base else None
    table = []
    for r in results:
        m = r.metrics if r.ok else {}
        generate = r.workload.get("scenario") == "generate"
        latency = m.get("e2e_ms" if generate else "latency_ms") or {}
        speedup = _speedup(r, m, base_tp)
        noise = m.get("noise") or {}
        row: dict[str, Any] = {
            "plan": r.plan.get("name"),
            "status": r.status,
            "latency_p50_ms": latency.get("p50"),
            "latency_p99_ms": latency.get("p99"),
            "throughput": m.get("throughput"),
            "throughput_unit": m.get("throughput_unit"),
            "peak_memory_mb": m.get("peak_memory_mb"),
            "speedup": speedup.get("value"),
            "speedup_low": speedup.get("low"),
            "speedup_high": speedup.get("high"),
            "speedup_verdict": speedup.get("verdict"),
            "speedup_reason": speedup.get("reason"),
            "noise": noise.get("level"),
            "noise_reason": noise_line(noise, "row") if noise and noise.get("level") != "quiet" else None,
            "memory_saving": 1 - m["peak_memory_mb"] / base_mem if base_mem and m.get("peak_memory_mb") else None,
            "quality": r.quality["verdict"] if r.quality else None,
            "quality_label": verdict_label(r.quality),
            "quality_figure": quality_headline(r.quality) if r.quality else None,
            "notes": _status_note(r, speedup, noise),
            "run_id": r.run_id,
        }
        if generate:
            row["ttft_p50_ms"] = (m.get("ttft_ms") or {}).get("p50")
            row["tpot_p50_ms"] = (m.get("tpot_ms") or {}).get("p50")
            row["decode_tokens_per_s"] = m.get("decode_tokens_per_s")
            row["roofline"] = "unknown" if m.get("roofline_unknown") else (m.get("roofline") or {}).get("fraction")
        elif m.get("mfu_unknown"):
            row["mfu"] = "unknown"
        elif m.get("mfu") is not None:
            row["mfu"] = m["mfu"]
        if r.quality:
            row["quality_metrics"] = r.quality.get("metrics")
            row["quality_intervals"] = r.quality.get("intervals")
        table.append(row)
    return table


def _pct(value: float | str | None) -> str:
    if isinstance(value, str):  # "unknown": the reason is in the row's notes
        return value
    return "-" if value is None else f"{value * 100:.1f}%"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _speedup_cell(row: dict[str, Any]) -> str:
    return speedup_text(row["speedup"], row.get("speedup_low"), row.get("speedup_high"), row.get("speedup_verdict"))


def render(results: list[Result], title: str, console: Console | None = None) -> None:
    console = console or make_console()
    data = rows(results)
    generate = any(r.workload.get("scenario") == "generate" for r in results)
    table = Table(title=title, title_justify="left")
    columns = ["plan", "p50 ms", "p99 ms"]
    columns += ["TTFT ms", "TPOT ms", "tokens/s", "roofline"] if generate else ["items/s", "MFU"]
    columns += ["peak MB", "speed-up", "mem saved", "quality", "noise", "notes"]
    for name in columns:
        table.add_column(name, overflow="fold", no_wrap=name != "notes")
    footnotes: list[str] = []
    for row in data:
        cells = [
            escape(row["plan"]),
            fmt(row["latency_p50_ms"]),
            fmt(row["latency_p99_ms"]),
        ]  # "baseline[batch_size=16]" is no markup
        if generate:
            cells += [
                fmt(row.get("ttft_p50_ms")),
                fmt(row.get("tpot_p50_ms")),
                fmt(row["throughput"]),
                _pct(row.get("roofline")),
            ]
        else:
            cells += [fmt(row["throughput"]), _pct(row.get("mfu"))]
        quality = row["quality"] or "-"
        noise = row.get("noise") or "-"
        cells += [
            fmt(row["peak_memory_mb"]),
            _speedup_cell(row),
            _pct(row["memory_saving"]),
            f"[{VERDICT_COLOURS.get(quality, 'white')}]{escape(row.get('quality_figure') or quality)}[/]",
            f"[{NOISE_COLOURS.get(noise, 'white')}]{noise}[/]",
            _footnote(row, footnotes),
        ]
        table.add_row(*cells)
    console.print(table)
    for i, note in enumerate(footnotes, 1):
        console.print(f"[dim]\\[{i}][/] {escape(note)}", highlight=False)


NOISE_COLOURS = {"quiet": "green", "noisy": "yellow", "unreliable": "red"}


def _footnote(row: dict[str, Any], footnotes: list[str]) -> str:
    """Notes are long sentences: the table shows a reference, the text follows the table."""
    if not row["notes"]:
        return ""
    footnotes.append(f"{row['plan']}: {row['notes']}")
    label = "unsupported" if row["status"] == "unsupported" else row["status"] if row["status"] != "ok" else "note"
    return f"{label} [{len(footnotes)}]"


CSV_FIELDS = [
    "plan",
    "status",
    "latency_p50_ms",
    "latency_p99_ms",
    "throughput",
    "throughput_unit",
    "peak_memory_mb",
    "speedup",
    "speedup_low",
    "speedup_high",
    "speedup_verdict",
    "memory_saving",
    "quality",
    "quality_figure",
    "noise",
    "notes",
    "run_id",
]


def to_csv(results: list[Result]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_FIELDS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows(results))
    return buffer.getvalue()


def to_markdown(results: list[Result]) -> str:
    header = "| plan | p50 ms | p99 ms | throughput | peak MB | speed-up | memory saved | quality | noise | notes |"
    lines = [header, "|" + "---|" * 10]
    for row in rows(results):
        unit = row.get("throughput_unit") or ""
        lines.append(
            f"| {row['plan']} | {fmt(row['latency_p50_ms'])} | {fmt(row['latency_p99_ms'])} | "
            f"{fmt(row['throughput'])} {unit} | {fmt(row['peak_memory_mb'])} | {_speedup_cell(row)} | "
            f"{_pct(row['memory_saving'])} | {row.get('quality_figure') or row['quality'] or '-'} | "
            f"{row.get('noise') or '-'} | "
            f"{row['notes'].replace('|', '/')} |"
        )
    return "\n".join(lines) + "\n"
