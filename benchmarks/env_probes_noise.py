"""`accelab env --refresh` quiet, then beside a switching load: do the probes keep their verdicts?

Two runs of the same command, one after the other, each with its own fresh measurement:
1. quiet: nothing else on purpose;
2. loaded: while a busy loop on one core switches on and off (tests/busy.py), as another
   user's job on a shared VM would.

For each technique probe it prints the factor against fp32, its 95% interval, the rounds used and
dropped, whether accelab trusted it (may be cached as a verdict), the loudest window it kept, and
the capability status `env` derives from it. A probe measured under noise must either agree with
the quiet one or say it is not trusted; the last line counts the verdicts that changed.

    python benchmarks/env_probes_noise.py                 # about 4 min here
    python benchmarks/env_probes_noise.py --on 3 --off 4 --core 1

The printout goes to benchmarks/results/env_probes_noise.txt (and .json beside it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from busy import switching_load
from machine import cpu_line, cpu_record

RESULTS = Path(__file__).parent / "results"


def run_env() -> tuple[dict[str, Any], float]:
    """One `accelab env --refresh --json` in a fresh process; its report and its wall time."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "env.json"
        start = time.monotonic()
        subprocess.run(
            [sys.executable, "-m", "accelab", "env", "--refresh", "--json", str(out)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        return json.loads(out.read_text()), time.monotonic() - start


def _cpu_limits(report: dict[str, Any]) -> dict[str, Any]:
    return next(lim for lim in report["limits"] if lim["device"] == "cpu")


def _statuses(report: dict[str, Any]) -> dict[str, str]:
    return {cap["technique"]: cap["status"] for cap in report["capabilities"]}


def describe(label: str, report: dict[str, Any], seconds: float) -> list[str]:
    now = report.get("noise_now") or {}
    cpu = _cpu_limits(report)
    status = _statuses(report)
    lines = [
        f"{label}: machine before the run {now.get('level', '?')}"
        + (f" ({now['reason']})" if now.get("level") not in (None, "quiet") else "")
        + f"; limits measured {(cpu.get('noise') or {}).get('level', '?')}; {seconds:.0f} s",
        f"  fp32 {cpu['fp32_flops'] / 1e9:.1f}, bf16 {(cpu['bf16_flops'] or 0) / 1e9:.1f} GFLOP/s; "
        f"bandwidth {cpu['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s",
    ]
    for name, d in (cpu.get("probe_details") or {}).items():
        interval = f"95% CI {d['low']:.2f}-{d['high']:.2f}" if d["low"] is not None else d["reason"]
        factor = f"{d['factor']:.2f}x" if d["factor"] is not None else "-"
        lines.append(
            f"  {name:<14} {factor} fp32 ({interval}), {d['rounds']} rounds used, {d['dropped']} dropped, "
            f"trusted {d['trusted']}, {d['noise']} -> {status.get(name, '-')}"
        )
    return lines


def changed_verdicts(quiet: dict[str, Any], loaded: dict[str, Any]) -> list[str]:
    """Techniques whose capability status differs between the runs although the loaded probe was trusted."""
    before, after = _statuses(quiet), _statuses(loaded)
    details = _cpu_limits(loaded).get("probe_details") or {}
    return [
        f"{name} ({before.get(name)} quiet, {after[name]} loaded)"
        for name, d in details.items()
        if d["trusted"] and before.get(name) != after.get(name)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--on", type=float, default=3.0, help="seconds the busy loop runs each cycle")
    parser.add_argument("--off", type=float, default=4.0, help="seconds it sleeps each cycle")
    parser.add_argument("--core", type=int, default=1, help="core it is pinned to (-1: anywhere)")
    parser.add_argument("--out", type=Path, default=RESULTS / "env_probes_noise.txt")
    args = parser.parse_args()

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True, text=True
    ).stdout.strip()
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    header = [
        cpu_line(),
        f"accelab env --refresh, quiet and beside a switching busy loop (tests/busy.py: {args.on:g} s busy / "
        f"{args.off:g} s asleep on core {args.core}), {stamp}, at {commit}",
        f"reproduce: python benchmarks/env_probes_noise.py --on {args.on:g} --off {args.off:g} --core {args.core}",
        "",
    ]
    print("\n".join(header), flush=True)
    quiet, quiet_s = run_env()
    block = describe("quiet", quiet, quiet_s)
    print("\n".join(block), flush=True)
    with switching_load(on_s=args.on, off_s=args.off, core=args.core):
        loaded, loaded_s = run_env()
    block2 = describe("loaded", loaded, loaded_s)
    print("\n".join(block2), flush=True)
    changed = changed_verdicts(quiet, loaded)
    summary = f"trusted loaded probes whose verdict differs from the quiet run: {len(changed)}" + (
        f" ({'; '.join(changed)})" if changed else ""
    )
    print("\n" + summary)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join([*header, *block, "", *block2, "", summary]) + "\n")
    args.out.with_suffix(".json").write_text(
        json.dumps({"cpu": cpu_record(), "quiet": quiet, "loaded": loaded}, indent=1, default=str)
    )


if __name__ == "__main__":
    main()
