"""The Result of a predict run (`kind="predict"`) and its report on the terminal.

How busy the device was, two ways: the CPU (or GPU, from NVML) utilisation sampled while the
ranks ran, and the share of each rank's wall time spent computing (copy to the device, model,
postprocessing) against waiting for the DataLoader. A low compute share with a high wait share
means the input pipeline is the limit: raise --workers.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from accelab.launch import Outcome
from accelab.measure.environment import environment, fingerprint
from accelab.predict.config import task_options
from accelab.predict.options import PredictRequest
from accelab.results.result import Result, ResultStatus, command_line


def workload_of(request: PredictRequest) -> dict[str, Any]:
    config, launch = request.config, request.launch

    return {
        "scenario": "predict",
        "task": config.task,
        "source": config.source,
        "source_format": request.source_format,
        "items": config.source_items,
        "limit": config.limit,
        "out": config.out,
        "output_format": config.output_format,
        "batch_size": config.batch_size,
        "chunk_size": config.chunk_size,
        "workers_per_process": config.workers,
        "nproc": launch.nproc,
        "nnodes": launch.nnodes,
        "world_size": launch.world_size,
        "threads_per_process": request.threads,
        **task_options(config),
    }


def metrics_of(summary: dict[str, Any], wall_s: float) -> dict[str, Any]:
    ranks = summary["ranks"]
    gpu_util = [r["gpu_util_percent"] for r in ranks if r["gpu_util_percent"] is not None]
    gpu_peak = [r["gpu_peak_allocated_mb"] for r in ranks if r["gpu_peak_allocated_mb"] is not None]
    busy = sum(r["compute_s"] for r in ranks)
    waiting = sum(r["wait_s"] for r in ranks)
    rank_wall = sum(r["wall_s"] for r in ranks)
    return {
        "items": summary["items_total"],
        "rows": summary["rows"],
        "skipped": summary["skipped"],
        "processed": summary["processed"],
        "done_before": summary["done_before"],
        "attempt": summary["attempt"],
        "wall_s": summary["wall_s"],
        "items_per_s": summary["items_per_s"],
        "total_wall_s": wall_s,
        "merge_s": summary["merge_s"],
        "per_process_items_per_s": [r["items_per_s"] for r in ranks],
        "compute_fraction": busy / rank_wall if rank_wall > 0 else None,
        "wait_fraction": waiting / rank_wall if rank_wall > 0 else None,
        "cpu_util_fraction": sum(r["cpu_util_fraction"] for r in ranks) / len(ranks),
        "gpu_util_percent": sum(gpu_util) / len(gpu_util) if gpu_util else None,
        "peak_rss_mb_max": max(r["peak_rss_mb"] for r in ranks),
        "peak_rss_mb_per_rank": [r["peak_rss_mb"] for r in ranks],
        "gpu_peak_allocated_mb_max": max(gpu_peak) if gpu_peak else None,
        "threads_per_process": ranks[0]["threads"],
        "device": ranks[0]["device"],
        "ranks": ranks,
        "skipped_path": summary["skipped_path"],
        "out": summary["out"],
    }


def result_of(
    request: PredictRequest, outcome: Outcome | None, *, unsupported: str | None = None, tag: str | None = None
) -> Result:
    env = environment()
    status: ResultStatus
    if unsupported is not None or outcome is None:
        status, reason, metrics, notes = "unsupported", unsupported, {}, []
    else:
        status, reason = outcome.status, outcome.reason
        metrics = metrics_of(outcome.summary, outcome.wall_s) if outcome.summary else {}
        notes = (outcome.summary or {}).get("notes", [])
    return Result(
        kind="predict",
        status=status,
        model=request.spec.to_dict(),
        plan=request.plan.to_dict(),
        workload=workload_of(request),
        metrics=metrics,
        environment=env,
        fingerprint=fingerprint(env),
        reason=reason,
        notes=list(dict.fromkeys([*request.notes, *notes])),
        command=command_line(),
        tag=tag,
    )


def _mib(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / 1024:.2f} GiB" if value >= 1024 else f"{value:.0f} MiB"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def print_run(result: Result, console: Console | None = None) -> None:
    console = console or Console()
    if not result.ok:
        console.print(f"[bold red]predict {result.status}[/]: {result.reason}")
        return
    m, w = result.metrics, result.workload
    first = m["ranks"][0]
    table = Table(
        title=f"accelab predict · {result.model['name']} ({w['task']}) · plan {result.plan['name']} · "
        f"batch {w['batch_size']} · {w['world_size']} process(es) on {first['device']}, "
        f"{first['threads']} thread(s) + {first['workers']} DataLoader worker(s) each",
        title_justify="left",
    )
    for column in ("process", "items", "items/s", "computing", "waiting", "busy", "peak memory"):
        table.add_column(column, justify="left" if column == "process" else "right")
    for r in m["ranks"]:
        gpu = r["gpu_util_percent"]
        busy = f"GPU {gpu:.0f}%" if gpu is not None else f"CPU {_pct(r['cpu_util_fraction'])}"
        memory = (
            _mib(r["gpu_peak_allocated_mb"]) + " GPU"
            if r["gpu_peak_allocated_mb"] is not None
            else _mib(r["peak_rss_mb"])
        )
        wall = r["wall_s"] or 1.0
        table.add_row(
            f"rank {r['rank']}",
            f"{r['items']:,}",
            f"{r['items_per_s']:,.1f}",
            _pct(r["compute_s"] / wall),
            _pct(r["wait_s"] / wall),
            busy,
            memory,
        )
    console.print(table)
    resumed = f" (resumed: {m['done_before']:,} were done before)" if m["done_before"] else ""
    console.print(
        f"{m['processed']:,} items in {m['wall_s']:.1f} s = [bold]{m['items_per_s']:,.1f} items/s[/]{resumed}; "
        f"{m['total_wall_s']:.1f} s with start-up and model load"
    )
    console.print(f"wrote {m['rows']:,} rows to {m['out']}")
    if m["skipped"]:
        console.print(f"[yellow]skipped {m['skipped']:,} unusable input(s)[/], listed in {m['skipped_path']}")
    if m["wait_fraction"] is not None and m["wait_fraction"] > 0.2:
        console.print(
            f"[yellow]the model waited on data {m['wait_fraction']:.0%} of the time: raise --workers "
            f"(now {w['workers_per_process']} per process)[/]"
        )
    for note in result.notes:
        console.print(f"note: {note}")
