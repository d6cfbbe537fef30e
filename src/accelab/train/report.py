"""Results of training runs: one `Result(kind="train")` per run or bench row, and their tables."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from accelab.catalog.spec import ModelSpec
from accelab.launch import LaunchOptions, Outcome
from accelab.measure.environment import environment, fingerprint
from accelab.plan.fields import Precision
from accelab.plan.plan import Plan
from accelab.results import contract as K
from accelab.results.result import Result, ResultStatus, command_line
from accelab.results.table import noise_cell, noise_line, speedup_text
from accelab.train.config import TrainConfig
from accelab.train.step_split import split_text

_PRECISION_NAMES: dict[str, Precision] = {"no": "fp32", "bf16": "bf16-autocast", "fp16": "fp16-autocast"}


def plan_of(name: str, config: TrainConfig) -> dict[str, Any]:
    return Plan(
        name=name,
        precision=_PRECISION_NAMES[config.mixed_precision],
        compile=config.compile,
        batch_size=config.batch_size,
        threads=config.threads,
    ).to_dict()


def workload_of(config: TrainConfig, launch: LaunchOptions) -> dict[str, Any]:
    return {
        "scenario": "train-step",
        "task": config.task,
        "dataset": config.dataset,
        "global_batch": config.batch_size,
        "grad_accum": config.grad_accum,
        "nproc": launch.nproc,
        "nnodes": launch.nnodes,
        "world_size": config.world_size,
        "per_process_batch": config.per_process_batch,
        "epochs": config.epochs,
        "max_steps": config.max_steps,
        "lr": config.lr,
        "schedule": config.schedule,
        "seed": config.seed,
        "gradient_checkpointing": config.gradient_checkpointing,
        "block_size": config.block_size,
        "image_size": config.image_size,
    }


def metrics_of(summary: dict[str, Any]) -> dict[str, Any]:
    """A worker's summary -> the Result's metrics (`accelab.results.contract.TRAIN`)."""
    timing, memory, final, losses = summary["timing"], summary["memory"], summary["final"], summary["losses"]
    out = {
        K.SAMPLES_PER_S: timing["samples_per_s"],
        K.EPOCH_S: timing["epoch_s"],
        K.EPOCH_S_ESTIMATED: timing["epoch_s_estimated"],
        K.STEP_MS: timing["step_ms"],
        K.TIMED_STEPS: timing["timed_steps"],
        K.TIMED_SAMPLES: timing["timed_samples"],
        K.TIMED_WALL_S: timing["timed_wall_s"],
        K.WARMUP_S: timing.get("warmup_s"),
        K.STEPS: summary["total_steps"],
        K.STEPS_PER_EPOCH: summary.get("steps_per_epoch"),
        K.PEAK_RSS_MB_MAX: memory["peak_rss_mb_max"],
        K.PEAK_RSS_MB_SUM: memory["peak_rss_mb_sum"],
        K.PEAK_RSS_MB_PER_RANK: memory["peak_rss_mb_per_rank"],
        K.GPU_PEAK_ALLOCATED_MB_MAX: memory["gpu_peak_allocated_mb_max"],
        K.STATE_MB_PER_RANK: memory.get("state_mb_per_rank"),
        K.STATE_MB_MAX: memory.get("state_mb_max"),
        K.SKIPPED_STEPS: summary["skipped_steps"],
        K.FINAL_LOSS: losses[-1] if losses else None,
        K.FIRST_LOSS: losses[0] if losses else None,
        K.LOSSES: losses,
        K.EVALS: summary["evals"],
        K.THREADS_PER_PROCESS: summary["threads"],
        K.DEVICE: summary["device"],
    }
    for key, name in ((K.ACCURACY, K.FINAL_ACCURACY), (K.PERPLEXITY, K.FINAL_PERPLEXITY)):
        if key in final:
            out[name] = final[key]
    if timing.get("split"):  # bench rows (config.step_breakdown)
        out[K.STEP_SPLIT] = timing["split"]
    return out


def result_of(
    *,
    name: str,
    spec: ModelSpec,
    config: TrainConfig,
    launch: LaunchOptions,
    outcome: Outcome | None,
    unsupported: str | None = None,
    group_id: str | None = None,
    tag: str | None = None,
    env: dict[str, Any] | None = None,
    notes: list[str] | None = None,
) -> Result:
    env = env if env is not None else environment()
    metrics: dict[str, Any] = {}
    status: ResultStatus
    reason: str | None
    if unsupported is not None:
        status, reason = "unsupported", unsupported
    else:
        assert outcome is not None
        status, reason = outcome.status, outcome.reason
        metrics = {**(metrics_of(outcome.summary) if outcome.summary else {}), K.WALL_S: outcome.wall_s}
    summary_notes = (outcome.summary or {}).get("notes", []) if outcome else []
    return Result(
        kind="train",
        status=status,
        model=spec.to_dict(),
        plan=plan_of(name, config),
        workload=workload_of(config, launch),
        metrics=metrics,
        environment=env,
        fingerprint=fingerprint(env),
        reason=reason,
        notes=[*(notes or []), *summary_notes],
        command=command_line(),
        tag=tag,
        group_id=group_id,
    )


# -- tables ---------------------------------------------------------------------------------------
def _seconds(value: float | None, estimated: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:.1f} s" + (" (est.)" if estimated else "")


def _mib(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / 1024:.2f} GiB" if value >= 1024 else f"{value:.0f} MiB"


def memory_cell(metrics: dict[str, Any]) -> str:
    gpu = metrics.get("gpu_peak_allocated_mb_max")
    if gpu is not None:
        return f"{_mib(gpu)} GPU"
    ranks = len(metrics.get("peak_rss_mb_per_rank") or [])
    cell = _mib(metrics.get("peak_rss_mb_max"))
    return cell + (f" x{ranks} ({_mib(metrics.get('peak_rss_mb_sum'))})" if ranks > 1 else "")


def quality_cell(metrics: dict[str, Any]) -> str:
    if metrics.get("final_accuracy") is not None:
        return f"{metrics['final_accuracy']:.2%}"
    if metrics.get("final_perplexity") is not None:
        return f"ppl {metrics['final_perplexity']:.2f}"
    return "-"


def mfu_cell(metrics: dict[str, Any]) -> str:
    if metrics.get(K.MFU) is not None:
        return f"{metrics[K.MFU]:.1%}"
    return "unknown" if metrics.get(K.MFU_UNKNOWN) else "-"


def row_cells(result: Result, baseline_sps: float | None) -> list[str]:
    m = result.metrics
    if not result.ok:
        return [result.plan["name"], "-", "-", "-", "-", "-", "-", "-", "-", f"{result.status} (below)"]
    sps = m.get("samples_per_s")
    paired = m.get(K.SPEEDUP)
    if isinstance(paired, dict):  # rows that took turns: the paired ratio of their rounds
        speedup = speedup_text(paired.get("value"), paired.get("low"), paired.get("high"), paired.get("verdict"))
    else:
        speedup = f"{sps / baseline_sps:.2f}x" if sps and baseline_sps else "-"
    note = f"{m['skipped_steps']} fp16 steps skipped" if m.get("skipped_steps") else ""
    return [
        result.plan["name"],
        _seconds(m.get("epoch_s"), m.get("epoch_s_estimated", False)),
        memory_cell(m),
        f"{sps:.1f}" if sps else "-",
        speedup,
        quality_cell(m),
        mfu_cell(m),
        split_text(m.get(K.STEP_SPLIT)),
        noise_cell(m.get(K.NOISE)),
        note,
    ]


def bench_table(results: list[Result], title: str, console: Console | None = None) -> None:
    table = Table(title=title, title_justify="left")
    for column in (
        "configuration",
        "epoch time",
        "peak memory",
        "samples/s",
        "vs baseline",
        "final quality",
        "MFU",
        "step split",
        "noise",
        "notes",
    ):
        table.add_column(
            column,
            justify="left" if column in ("configuration", "step split", "notes") else "right",
            no_wrap=column == "configuration",
        )
    baseline = next((r.metrics.get("samples_per_s") for r in results if r.ok), None)
    for result in results:
        table.add_row(*row_cells(result, baseline))
    console = console or Console()
    console.print(table)
    for result in results:
        if not result.ok:
            console.print(f"{result.plan['name']}: {result.status}: {result.reason}", style="yellow")
        elif (result.metrics.get(K.NOISE) or {}).get("level") not in (None, "quiet"):
            console.print(f"{result.plan['name']}: {noise_line(result.metrics[K.NOISE], 'row')}", style="yellow")
        if result.ok and result.metrics.get(K.MFU_UNKNOWN):
            console.print(f"{result.plan['name']}: {result.metrics[K.MFU_UNKNOWN]}", style="yellow")
        if isinstance(result.metrics.get(K.SPEEDUP), dict) and result.metrics[K.SPEEDUP].get("verdict") in (
            "unreliable",
            "no measurable difference",
        ):
            console.print(f"{result.plan['name']}: speed-up {result.metrics[K.SPEEDUP]['reason']}", style="yellow")
    threads = ", ".join(
        f"{r.plan['name']} {r.metrics['threads_per_process']}" for r in results if r.metrics.get("threads_per_process")
    )
    if threads:
        console.print(f"intra-op threads per process: {threads}", style="dim")
    console.print(
        "samples/s = samples of the timed steps / their wall time (first steps excluded); peak memory = "
        "per-process RSS peak, max over ranks (sum in brackets), or torch's peak GPU allocation",
        style="dim",
    )
    _split_legend(results, console)


def _split_legend(results: list[Result], console: Console) -> None:
    """What the MFU and step split columns mean, and where each row's communication is."""
    if not any(r.metrics.get(K.STEP_SPLIT) for r in results):
        return
    console.print(
        "MFU = 3 x forward FLOPs per sample x samples/s / the measured peak of the row's compute path, "
        "scaled to its threads (CPU) or GPUs; step split = each phase's share of the timed steps' time "
        "(other: loss sync, logging, turn-taking)",
        style="dim",
    )
    for result in results:
        split = result.metrics.get(K.STEP_SPLIT)
        if split and split.get("comm") != "none":
            console.print(f"{result.plan['name']}: {split['comm_note']}", style="dim")


def print_run(result: Result, console: Console | None = None) -> None:
    console = console or Console()
    m, w = result.metrics, result.workload
    table = Table(
        title=f"accelab train · {result.model['name']} · {w['dataset'] or 'held-out text'}",
        title_justify="left",
        show_header=False,
    )
    table.add_column("", style="bold")
    table.add_column("")
    rows = [
        ("status", result.status + (f": {result.reason}" if result.reason else "")),
        (
            "processes",
            (
                f"{w['world_size']} x batch {w['per_process_batch']} x accum {w['grad_accum']} "
                f"= global batch {w['global_batch']}"
            ),
        ),
        ("steps", str(m.get("steps", "-"))),
        ("loss", f"{m['first_loss']:.4f} -> {m['final_loss']:.4f}" if m.get("final_loss") is not None else "-"),
        ("final eval", quality_cell(m)),
        ("samples/s", f"{m['samples_per_s']:.1f}" if m.get("samples_per_s") else "-"),
        ("epoch time", _seconds(m.get("epoch_s"), m.get("epoch_s_estimated", False))),
        ("peak memory", memory_cell(m) if m else "-"),
    ]
    if m.get("skipped_steps"):
        rows.append(("fp16 skipped steps", str(m["skipped_steps"])))
    for label, value in rows:
        table.add_row(label, value)
    console.print(table)
    for note in result.notes:
        console.print(f"note: {note}", style="yellow")
