"""Rich tables for Results. Pure formatting: no measurement, no store access."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from accelab.results.result import Result


def make_console(stderr: bool = False) -> Console:
    """A terminal keeps its width; a pipe or a log file gets 160 columns, so tables stay tables."""
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else 160)


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits}g}"
    return str(value)


def _stat_line(stats: dict[str, float] | None, unit: str = "ms") -> str:
    if not stats:
        return "-"
    return (
        f"p50 {fmt(stats['p50'])} · p90 {fmt(stats['p90'])} · p99 {fmt(stats['p99'])} {unit}"
        f"  (mean {fmt(stats['mean'])}, cv {stats['cv'] * 100:.1f}%, n={stats['n']})"
    )


def noise_line(noise: dict[str, Any] | None, what: str = "run") -> str:
    """The noise of a Result in a sentence: how loud the machine was and what that means for
    its figures (`accelab.measure.noise`). "-" for Results stored before noise was measured."""
    if not noise:
        return "-"
    used, rounds = noise.get("rounds_used", 0), noise.get("rounds", 0)
    figures = (
        f"steal {noise.get('steal_max', 0) * 100:.0f}% at most, other processes "
        f"{noise.get('others_cores_max', 0):.2f} cores at most, load {noise.get('load1', 0):.1f}"
    )
    if noise.get("level") == "unreliable":
        return (
            f"unreliable: {noise.get('reason')} during this {what}; {used} of {rounds} rounds were quiet enough "
            f"({figures}). Do not trust these figures: run again on a quieter machine"
        )
    kept = f"{used} of {rounds} rounds used" + (" (the others were left out as unreliable)" if used < rounds else "")
    if noise.get("level") == "noisy":
        return f"noisy: {noise.get('reason')}; {kept} ({figures})"
    return f"quiet: {kept} ({figures})"


def noise_cell(noise: dict[str, Any] | None) -> str:
    """The table cell: quiet / noisy / unreliable ("-" when not measured)."""
    return str(noise.get("level")) if noise else "-"


def speedup_text(
    value: float | None, low: float | None = None, high: float | None = None, verdict: str | None = None
) -> str:
    """A paired speed-up cell (accelab.measure.paired): 1.42x (1.38-1.47) when its interval
    decides, the words when it does not, the bare ratio for a row without rounds."""
    if verdict in ("unreliable", "no measurable difference"):
        return verdict
    if value is None:
        return "-"
    if low is not None and high is not None:
        return f"{value:.2f}x ({low:.2f}-{high:.2f})"
    return f"{value:.2f}x"


def bench_rows(result: Result) -> list[tuple[str, str]]:
    """(label, value) rows describing one bench Result, most important first."""
    m = result.metrics
    rows = [*_identity_rows(result), ("status", result.status + (f": {result.reason}" if result.reason else ""))]
    if not result.ok:
        return rows
    rows += _generate_rows(m) if result.workload.get("scenario") == "generate" else _forward_rows(m)
    rows += [
        ("noise", noise_line(m.get("noise"))),
        ("peak memory", f"{fmt(m.get('peak_memory_mb'))} MB"),
        ("load / first call", f"{fmt(m.get('load_s'))} s / {fmt(m.get('first_call_s'))} s"),
        (
            "threads",
            f"{m.get('threads', {}).get('intra_op')} intra-op, {m.get('threads', {}).get('inter_op')} inter-op",
        ),
    ]
    if m.get("sample_text") is not None:
        rows.append(("sample output", repr(m["sample_text"][:200])))
    for note in result.notes:
        rows.append(("note", note))
    return rows


def _identity_rows(result: Result) -> list[tuple[str, str]]:
    """What was measured: the model, the plan and the workload's shape."""
    wl = result.workload
    shape = (
        f"{wl.get('scenario')} batch={wl.get('batch_size')}"
        + (f" seq={wl.get('seq_len')}" if result.model.get("task") in ("feature-extraction",) else "")
        + (f" new_tokens={wl.get('new_tokens')}" if wl.get("scenario") == "generate" else "")
    )
    return [
        ("model", f"{result.model.get('name')} ({result.model.get('task')})"),
        ("plan", result.plan.get("name", "")),
        ("workload", shape),
    ]


def _generate_rows(m: dict[str, Any]) -> list[tuple[str, str]]:
    """Generation: the per-token latencies, the rates, and the share of the memory-bandwidth bound."""
    rows = [
        ("TTFT", _stat_line(m.get("ttft_ms"))),
        ("TPOT", _stat_line(m.get("tpot_ms"))),
        ("ITL", _stat_line(m.get("itl_ms"))),
        ("end-to-end", _stat_line(m.get("e2e_ms"))),
        ("decode tokens/s", fmt(m.get("decode_tokens_per_s"))),
        ("tokens/s (all)", fmt(m.get("throughput"))),
    ]
    roof = m.get("roofline") or {}
    if m.get("roofline_unknown"):
        rows.append(("roofline", m["roofline_unknown"]))
    elif roof:
        rows.append(
            (
                "roofline",
                f"{roof.get('fraction', 0) * 100:.1f}% of the memory-bandwidth bound "
                f"({fmt(roof.get('bound_steps_per_s'))} steps/s for "
                f"{fmt((m.get('weight_bytes') or 0) / 1e6)} MB of weights)",
            )
        )
    return rows


def _forward_rows(m: dict[str, Any]) -> list[tuple[str, str]]:
    """A forward pass: latency, throughput, and the share of the peak compute measured here (MFU)."""
    rows = [
        ("latency", _stat_line(m.get("latency_ms"))),
        ("throughput", f"{fmt(m.get('throughput'))} {m.get('throughput_unit', 'items/s')}"),
    ]
    if m.get("mfu_unknown"):
        rows.append(("MFU", m["mfu_unknown"]))
    elif m.get("mfu") is not None:
        hw = m.get("hardware", {})
        rows.append(
            (
                "MFU",
                f"{m['mfu'] * 100:.1f}% ({fmt(m.get('achieved_flops', 0) / 1e9)} GFLOP/s of the "
                f"{fmt((hw.get('peak_flops') or 0) / 1e9)} GFLOP/s {hw.get('compute_path', 'fp32')} peak "
                "measured here)",
            )
        )
    return rows


def print_bench(result: Result, console: Console | None = None) -> None:
    console = console or make_console()
    table = Table(title=f"accelab bench · run {result.run_id}", show_header=False, title_justify="left")
    table.add_column(style="bold cyan", no_wrap=True)
    table.add_column()
    for label, value in bench_rows(result):
        table.add_row(label, escape(value))  # plan names and notes may hold brackets
    console.print(table)


VERDICT_COLOURS = {"pass": "green", "warn": "yellow", "fail": "red", "cannot tell": "cyan"}
# the figure each task's quality cell shows beside its verdict (the first of these measured)
HEADLINE = ("mean_kl", "top1_agreement", "cosine_mean")


def figure_text(quality: dict[str, Any], name: str, digits: int = 4) -> str:
    """A figure with its 95% interval: "0.0031 (0.0024-0.0040)"; the bare value where it has none."""
    value = (quality.get("metrics") or {}).get(name)
    interval = (quality.get("intervals") or {}).get(name)

    def show(x: float | None) -> str:  # a ratio near 1 keeps its decimals: 1.0031, not 1
        return "?" if x is None else f"{x:.4f}" if name.endswith("_ratio") else fmt(x, digits)

    if value is None or not interval:
        return show(value) if isinstance(value, float) else fmt(value, digits)
    return f"{show(value)} ({show(interval[0])}-{show(interval[1])})"


def quality_headline(quality: dict[str, Any] | None) -> str:
    """The verdict and its deciding figure, compactly: "pass · mean_kl 0.0031 (0.0024-0.0040)"."""
    if not quality:
        return "-"
    name = next((n for n in HEADLINE if n in (quality.get("intervals") or {})), None)
    word = verdict_label(quality) or "-"
    return word if name is None else f"{word} · {name} {figure_text(quality, name, 2)}"


def verdict_label(quality: dict[str, Any] | None) -> str | None:
    """The verdict in a few words: "pass", "cannot tell (pass or warn)" (`quality.verdict.label`,
    stored with the Result); None: not checked."""
    if not quality:
        return None
    return quality.get("label") or quality.get("verdict")


def verdict_line(quality: dict[str, Any]) -> str:
    verdict = quality["verdict"]
    colour = VERDICT_COLOURS.get(verdict, "white")
    text = f"[bold {colour}]{escape(verdict_label(quality) or verdict)}[/] ({quality['tolerance']})"
    if quality.get("samples_needed"):
        text += f"; about --samples {quality['samples_needed']} would tell"
    elif verdict == "cannot tell":
        text += "; an estimate sits on a line: no sample size tells"
    return text


def sample_line(quality: dict[str, Any]) -> str | None:
    sample = quality.get("sample") or {}
    if not sample.get("n"):
        return None
    text = f"{sample['n']} {sample.get('unit', 'samples')}"
    if sample.get("window"):
        text += f" of the evaluation text ({sample['window']}: {sample.get('positions', 0):,} positions)"
    return text + (f"; 95% intervals: {sample['method']}" if sample.get("method") else "")


def print_verify(result: Result, console: Console | None = None) -> None:
    console = console or make_console()
    table = Table(title=f"accelab verify · run {result.run_id}", show_header=False, title_justify="left")
    table.add_column(style="bold cyan", no_wrap=True)
    table.add_column()
    table.add_row("model", f"{result.model.get('name')} ({result.model.get('task')})")
    table.add_row("plan", escape(str(result.plan.get("name"))))
    table.add_row("reference", "fp32 eager, same real inputs, own process")
    table.add_row("samples", str(result.workload.get("samples")))
    quality = result.quality
    if quality is None:
        table.add_row("status", f"{result.status}: {result.reason}")
    else:
        table.add_row("verdict", verdict_line(quality))
        sample = sample_line(quality)
        if sample:
            table.add_row("scored", escape(sample))
        if (quality.get("sample") or {}).get("kl_over"):
            table.add_row("KL over", escape(quality["sample"]["kl_over"]))
        for key in quality["metrics"]:
            table.add_row(key, figure_text(quality, key))
        for line in quality["rules"]:
            table.add_row("rule", escape(line))
        if quality.get("source"):
            table.add_row("lines from", escape(quality["source"]))
    for note in result.notes:
        table.add_row("note", escape(note))
    console.print(table)
