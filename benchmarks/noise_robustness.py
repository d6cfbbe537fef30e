"""The demo's compare tables, quiet and beside a switching load, side by side: how many rows agree.

Three measurements of each of `make demo`'s compare tables (examples/demo.sh), in one run:
1. quiet: `accelab compare` as the demo runs it, nothing else on purpose (the reference);
2. loaded: the same command while a busy loop on one core switches on and off (tests/busy.py:
   busy ON_S seconds, asleep OFF_S, over and over), as another user's job on a shared VM;
3. the old way under the same load: the plans one after another (`--sequential`), every round
   kept, the speed-up a plain ratio of the pooled rates, no noise measured: what accelab
   printed before it measured noise.

For every row it prints the verdict of each (faster / slower / no measurable difference /
unreliable, or the plain ratio of the old way), and counts: rows that agree with the quiet
table, rows that say they cannot tell ("unreliable" or "no measurable difference" where quiet
decided), and confident wrong rows (a decided verdict the quiet table contradicts, or a
speed-up of 10% or more where quiet found no measurable difference). Each window's CPU steal
and other processes' CPU are in every Result (metrics.noise, metrics.rounds); the table shows
the worst of each row. The whole printout and a JSON go to benchmarks/results/.

    python benchmarks/noise_robustness.py                  # the demo's four tables, ~40 min here
    python benchmarks/noise_robustness.py --tables minilm,resnet50 --on 3 --off 4
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from busy import switching_load
from machine import cpu_line, cpu_record

RESULTS = Path(__file__).parent / "results"
GENERATE = ["--scenario", "generate", "--new-tokens", "32", "--min-seconds", "2", "--min-iters", "3", "--warmup", "1"]
TABLES: dict[str, list[str]] = {  # the demo's compare commands (examples/demo.sh), quality off: speed only
    "smollm2": ["smollm2-135m", *GENERATE, "--plans", "baseline,bf16-autocast,fp16-autocast,static-cache,int8-weight"],
    "smollm2-batch": ["smollm2-135m", *GENERATE, "--plans", "baseline,baseline[batch_size=16]"],
    "minilm": [
        "minilm-l6",
        "--batch-size",
        "32",
        "--seq-len",
        "128",
        "--plans",
        "baseline,bf16-autocast,fp16-autocast,int8-dynamic,compile",
    ],
    "resnet50": ["resnet-50", "--batch-size", "8", "--plans", "baseline,channels-last,bf16-autocast,compile"],
}
UNDECIDED = {"unreliable", "no measurable difference"}


def compare(args: list[str], out: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", "accelab", "compare", *args, "--no-quality", "--no-store", "--json", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    if proc.returncode not in (0, 1) or not out.exists():
        raise RuntimeError(f"{shlex.join(command)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def old_way(doc: dict[str, Any]) -> dict[str, float | None]:
    """What the sequential run would have printed before noise was measured: pooled rate over
    every round (none dropped) against the first plan's."""
    rates = {}
    for r in doc["results"]:
        rounds = (r.get("metrics") or {}).get("rounds") or []
        total_s = sum(x["seconds"] for x in rounds)
        rates[r["plan"]["name"]] = sum(x["rate"] * x["seconds"] for x in rounds) / total_s if total_s else None
    base = next(iter(rates.values()), None)
    return {name: (rate / base if rate and base else None) for name, rate in rates.items()}


def verdict_of(row: dict[str, Any]) -> str | None:
    if row["status"] != "ok":
        return None
    return row.get("speedup_verdict") or "reference"


def plain_verdict(ratio: float | None) -> str | None:
    """The old way's claim, read as a user would: a ratio away from 1 is a claim of a change."""
    if ratio is None:
        return None
    if abs(ratio - 1) < 0.02:
        return "no measurable difference"
    return "faster" if ratio > 1 else "slower"


def judge(quiet: str | None, other: str | None, ratio: float | None = None) -> str:
    """agree | cannot tell | WRONG, against the quiet row; "-" where the quiet row is no reference."""
    if quiet in (None, "reference", "unreliable") or other is None:
        return "-"
    if other == quiet:
        return "agree"
    if other in UNDECIDED:
        return "cannot tell"
    if quiet == "no measurable difference" and ratio is not None and abs(ratio - 1) < 0.10:
        return "agree"  # a small move called a change: not a confident wrong row at this size
    return "WRONG"


def steal_window() -> tuple[int, int]:
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:9]
    values = [int(v) for v in fields]
    return values[7], sum(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", default=",".join(TABLES), help=f"of {', '.join(TABLES)}")
    parser.add_argument("--on", type=float, default=3.0, help="seconds the loop is busy")
    parser.add_argument("--off", type=float, default=4.0, help="seconds the loop sleeps")
    parser.add_argument("--core", type=int, default=1, help="the core the loop runs on (-1: any)")
    opts = parser.parse_args()
    console = Console(width=170, record=True)
    reproduce = shlex.join([sys.executable, *sys.argv])
    console.print(cpu_line(), markup=False, soft_wrap=True)  # one line, however long
    console.print(f"reproduce: {reproduce}")
    summary: dict[str, dict[str, int]] = {"loaded (accelab now)": {}, "old way, loaded": {}}
    docs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in [t.strip() for t in opts.tables.split(",") if t.strip()]:
            args = TABLES[name]
            runs: dict[str, Any] = {}
            for condition in ("quiet", "loaded", "sequential"):
                steal0, total0 = steal_window()
                started = time.monotonic()
                extra = ["--sequential"] if condition == "sequential" else []
                if condition == "quiet":
                    runs[condition] = compare(args + extra, Path(tmp) / f"{name}-{condition}.json")
                else:
                    with switching_load(on_s=opts.on, off_s=opts.off, core=opts.core):
                        runs[condition] = compare(args + extra, Path(tmp) / f"{name}-{condition}.json")
                steal1, total1 = steal_window()
                runs[condition]["window"] = {
                    "seconds": time.monotonic() - started,
                    "steal": (steal1 - steal0) / max(total1 - total0, 1),
                }
            docs[name] = runs
            _table(console, name, args, runs, summary)
    console.print("\n[bold]rows, of the decided quiet rows:[/]")
    for condition, counts in summary.items():
        console.print(f"  {condition}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "noise_robustness.txt").write_text(console.export_text())
    (RESULTS / "noise_robustness.json").write_text(
        json.dumps({"cpu": cpu_record(), "reproduce": reproduce, "tables": docs}, indent=1, default=str)
    )


def _table(
    console: Console, name: str, args: list[str], runs: dict[str, Any], summary: dict[str, dict[str, int]]
) -> None:
    quiet = {r["plan"]: r for r in runs["quiet"]["rows"]}
    loaded = {r["plan"]: r for r in runs["loaded"]["rows"]}
    plain = old_way(runs["sequential"])
    windows = ", ".join(
        f"{k} {v['window']['seconds']:.0f} s steal {v['window']['steal'] * 100:.1f}%" for k, v in runs.items()
    )
    table = Table(title=escape(f"{name}: accelab compare {shlex.join(args)}  ({windows})"), title_justify="left")
    for column in (
        "plan",
        "quiet",
        "quiet noise",
        "loaded",
        "loaded noise",
        "vs quiet",
        "old way (loaded)",
        "vs quiet",
    ):
        table.add_column(column)
    for plan, q in quiet.items():
        lo = loaded.get(plan, {})
        qv, lv = verdict_of(q), verdict_of(lo) if lo else None
        ov = plain_verdict(plain.get(plan)) if plan != next(iter(quiet)) else "reference"
        now, before = judge(qv, lv, lo.get("speedup")), judge(qv, ov, plain.get(plan))
        for condition, outcome in (("loaded (accelab now)", now), ("old way, loaded", before)):
            if outcome != "-":
                summary[condition][outcome] = summary[condition].get(outcome, 0) + 1
        table.add_row(
            escape(plan),
            _cell(q),
            q.get("noise") or "-",
            _cell(lo) if lo else "-",
            lo.get("noise") or "-",
            now,
            f"{plain[plan]:.2f}x" if plain.get(plan) else "-",
            before,
        )
    console.print(table)


def _cell(row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        return row["status"]
    verdict = row.get("speedup_verdict")
    if verdict in UNDECIDED:
        return verdict
    if row.get("speedup_low") is not None:
        return f"{row['speedup']:.2f}x ({row['speedup_low']:.2f}-{row['speedup_high']:.2f}) {verdict}"
    return f"{row['speedup']:.2f}x" if row.get("speedup") else "-"


if __name__ == "__main__":
    main()
