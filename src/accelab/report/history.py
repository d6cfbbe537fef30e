"""`accelab history`: the runs in the store as rows, a rich table, CSV and JSON. Pure formatting."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from accelab.report import metrics as M
from accelab.results.result import Result
from accelab.units import parse_duration_s

FIELDS = [
    "run_id",
    "created",
    "kind",
    "model",
    "plan",
    "scenario",
    "batch_size",
    "status",
    "key_metric",
    "latency_p50_ms",
    "latency_p99_ms",
    "throughput",
    "throughput_unit",
    "peak_memory_mb",
    "quality",
    "tag",
    "group_id",
    "fingerprint",
]
STATUS_COLOURS = {"ok": "green", "unsupported": "yellow"}
QUALITY_COLOURS = {"pass": "green", "warn": "yellow", "fail": "red", "cannot tell": "cyan"}


def parse_since(text: str, now: dt.datetime | None = None) -> str:
    """'2026-11-01', '2026-11-01T08:00' or an age ('30m', '12h', '7d', '2w') -> ISO-8601 UTC,
    in the format the store's `created` column uses (so the store compares strings)."""
    now = now or dt.datetime.now(dt.timezone.utc)
    try:
        moment = now - dt.timedelta(seconds=parse_duration_s(text, "--since", units=("m", "h", "d", "w"), bare=None))
    except ValueError:
        try:
            moment = dt.datetime.fromisoformat(text.strip())
        except ValueError:
            raise ValueError(
                f"--since {text!r} is neither a date nor an age; give e.g. --since 2026-11-01 or --since 7d "
                "(m, h, d, w)"
            ) from None
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=dt.timezone.utc)
    return moment.astimezone(dt.timezone.utc).isoformat(timespec="seconds")


def row(result: Result) -> dict[str, Any]:
    """One run as plain values (numbers stay numbers) for CSV / JSON."""
    return {
        "run_id": result.run_id,
        "created": result.created,
        "kind": result.kind,
        "model": M.model_name(result),
        "plan": M.plan_name(result),
        "scenario": result.workload.get("scenario"),
        "batch_size": M.batch_size(result),
        "status": result.status,
        "key_metric": M.key_metric(result),
        "latency_p50_ms": M.stat(result, "p50"),
        "latency_p99_ms": M.stat(result, "p99"),
        "throughput": M.throughput(result),
        "throughput_unit": M.throughput_unit(result) if M.throughput(result) is not None else None,
        "peak_memory_mb": M.peak_memory_mb(result),
        "quality": M.quality_verdict(result),
        "tag": result.tag,
        "group_id": result.group_id,
        "fingerprint": result.fingerprint,
    }


def rows(results: list[Result]) -> list[dict[str, Any]]:
    return [row(r) for r in results]


def short_time(created: str) -> str:
    """'2026-11-30T08:48:27+00:00' -> '2026-11-30 08:48' (UTC, as stored)."""
    return created[:16].replace("T", " ")


def table(results: list[Result], title: str) -> Table:
    t = Table(title=title, title_justify="left")
    for name in (
        "run",
        "created (UTC)",
        "kind",
        "model",
        "plan",
        "scenario",
        "batch",
        "status",
        "key metric",
        "tag",
        "machine",
    ):
        t.add_column(name, overflow="fold", no_wrap=name in ("run", "created (UTC)"))
    for r in results:
        colour = STATUS_COLOURS.get(r.status, "red")
        key = M.key_metric(r)
        verdict = M.quality_verdict(r)
        if verdict:
            key = key.replace(f"quality {verdict}", f"quality [{QUALITY_COLOURS.get(verdict, 'white')}]{verdict}[/]")
        t.add_row(
            r.run_id,
            short_time(r.created),
            r.kind,
            escape(M.model_name(r)),
            escape(M.plan_name(r)),
            str(r.workload.get("scenario") or "-"),
            str(M.batch_size(r) or "-"),
            f"[{colour}]{r.status}[/]",
            key,
            r.tag or "",
            r.fingerprint or "-",
        )
    return t


def render(results: list[Result], title: str, console: Console | None = None) -> None:
    console = console or Console()
    console.print(table(results, title))
    fingerprints = {r.fingerprint for r in results if r.fingerprint}
    if len(fingerprints) > 1:
        console.print(
            f"[yellow]{len(fingerprints)} machines (fingerprints) in this list: "
            "results from different machines are not compared as equals[/]"
        )


def to_csv(results: list[Result]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=FIELDS)
    writer.writeheader()
    writer.writerows(rows(results))
    return buffer.getvalue()


def to_json(results: list[Result]) -> str:
    """The rows and the full Results: the same shape as `accelab compare --json`, so the file is
    also a REF for `accelab regress` and `accelab report --compare`."""
    doc = {"rows": rows(results), "results": [r.to_dict() for r in results]}
    return json.dumps(doc, indent=2, default=str)
