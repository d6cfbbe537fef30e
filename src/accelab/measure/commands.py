"""`accelab env`: this machine, its software, its measured limits, and what each technique can
do here. Heavy imports (torch) happen inside the command so that `accelab --help` stays fast."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import typer

STATUS_STYLE = {"ok": "green", "slow": "yellow", "unsupported": "red"}


def register(app: typer.Typer) -> None:
    @app.command("env")
    def env(
        json_file: Path | None = typer.Option(None, "--json", help="Also write the whole report to this JSON file."),
        refresh: bool = typer.Option(
            False, "--refresh", help="Measure the hardware limits again instead of using the cache."
        ),
        measure: bool = typer.Option(
            True, "--measure/--no-measure", help="Include measured peak FLOP/s and bandwidth."
        ),
    ) -> None:
        """Hardware and software report: CPU capability, GPUs, versions, measured peak matmul
        FLOP/s and memory bandwidth (cached), and what each technique can do here."""
        from rich.console import Console

        console = Console()
        with console.status("measuring hardware limits (cached after the first run)"):
            report = build_report(measure=measure, refresh=refresh)
        render(report, console)
        if json_file is not None:
            json_file.write_text(json.dumps(report, indent=2, default=str))
            console.print(f"report written to {json_file}")


def build_report(*, measure: bool = True, refresh: bool = False) -> dict[str, Any]:
    """The whole `accelab env` report as one JSON-serialisable dict."""
    import torch

    from accelab.measure import noise
    from accelab.measure.capabilities import capabilities
    from accelab.measure.environment import environment, fingerprint
    from accelab.measure.hardware import hardware_limits

    now = noise.sample_now(1.0)  # before measuring: what the machine does on its own
    env = environment()
    limits = []
    if measure:
        devices = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        limits = [hardware_limits(device, refresh=refresh) for device in devices]
    cpu_limits = next((lim for lim in limits if lim.device == "cpu"), None)
    return {
        "environment": env,
        "fingerprint": fingerprint(env),
        "limits": [asdict(lim) for lim in limits],
        "capabilities": [asdict(cap) for cap in capabilities(env, cpu_limits)],
        "noise_now": now.to_dict() if now is not None else None,
    }


def render(report: dict[str, Any], console: Any) -> None:
    """Print the report as rich tables: machine, versions, limits, capabilities."""
    from rich.table import Table

    env = report["environment"]
    machine = Table(title=f"machine (fingerprint {report['fingerprint']})", show_header=False)
    for key, value in _machine_rows(env):
        machine.add_row(key, value)
    console.print(machine)

    versions = Table(title="software", show_header=False)
    for name, version in env["versions"].items():
        versions.add_row(name, version or "[dim]not installed[/dim]")
    console.print(versions)

    console.print(f"machine now: {noise_now_text(report.get('noise_now'))}")
    if report["limits"]:
        limits = Table(title="measured limits (best of a few runs)")
        for column in (
            "device",
            "threads",
            "fp32 GFLOP/s",
            "bf16 GFLOP/s",
            "tf32 GFLOP/s",
            "read GB/s",
            "measured (UTC)",
            "noise then",
        ):
            limits.add_column(column)
        for lim in report["limits"]:
            limits.add_row(
                lim["device"],
                str(lim["threads"]),
                _giga(lim["fp32_flops"]),
                _giga(lim["bf16_flops"]),
                _giga(lim["tf32_flops"]),
                _giga(lim["bandwidth_bytes_per_s"]),
                lim["measured_at"][:16].replace("T", " "),
                _limits_noise(lim),
            )
        console.print(limits)

    caps = Table(title="what each technique can do here")
    for column in ("technique", "status", "why"):
        caps.add_column(column)
    for cap in report["capabilities"]:
        style = STATUS_STYLE[cap["status"]]
        caps.add_row(cap["technique"], f"[{style}]{cap['status']}[/{style}]", cap["reason"])
    console.print(caps)


def _machine_rows(env: dict[str, Any]) -> list[tuple[str, str]]:
    cpu = env["cpu"]
    isa = [flag for flag, present in cpu["flags"].items() if present]
    rows = [
        ("host", env["hostname"]),
        ("cpu", env["cpu_model"]),
        (
            "cores",
            f"{env['physical_cores']} physical, {env['logical_cores']} logical, {env['available_cores']} available",
        ),
        ("cpu flags", " ".join(isa) or "unknown"),
        ("cpu level", cpu.get("level", "unknown")),  # the kind of CPU accelab's paths take (ACCELAB_CPU_ISA caps it)
        (
            "torch cpu",
            f"{cpu['torch_capability']}; native bf16: {cpu['native_bf16']}, native fp16: {cpu['native_fp16']}",
        ),
        ("ram", f"{env['ram_total_bytes'] / 2**30:.1f} GiB"),
        ("torch threads", f"{env['torch_threads']['intra_op']} intra-op, {env['torch_threads']['inter_op']} inter-op"),
        ("c compiler", env["c_compiler"] or "none"),
    ]
    for gpu in env["gpus"]:
        memory = f"{gpu['memory_total_mb'] / 1024:.1f} GiB" if gpu["memory_total_mb"] else "?"
        rows.append(
            (
                f"gpu {gpu['index']}",
                f"{gpu['name']}, {memory}, cc {gpu['compute_capability']}, driver {gpu['driver_version']}",
            )
        )
    if not env["gpus"]:
        rows.append(("gpu", "none"))
    return rows


def noise_now_text(now: dict[str, Any] | None) -> str:
    """One line on how loud the machine is (a 1 s window in which accelab only slept)."""
    if not now:
        return "not measured (no /proc/stat here)"
    figures = (
        f"steal {now['steal'] * 100:.0f}%, other processes {now['others_cores']:.2f} cores, load {now['load1']:.1f}"
    )
    if now["level"] == "quiet":
        return f"[green]quiet[/] ({figures})"
    colour = "yellow" if now["level"] == "noisy" else "red"
    return (
        f"[{colour}]{now['level']}[/]: {now['reason']} ({figures}); measurements now will say so, "
        "and probes measured now are not cached as verdicts"
    )


def _limits_noise(lim: dict[str, Any]) -> str:
    noise = lim.get("noise") or {}
    untrusted = [name for name, d in (lim.get("probe_details") or {}).items() if not d.get("trusted", True)]
    text = noise.get("level", "-")
    if noise.get("level") not in (None, "quiet"):
        text += f": {noise.get('reason')}"
    if untrusted:
        text += f"; probes under noise: {', '.join(untrusted)}"
    return text


def _giga(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e9:,.1f}"
