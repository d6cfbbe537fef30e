"""Does a quality verdict hold when the sample grows? `accelab verify smollm2-135m --plan P` at
three sample sizes for each plan, the teacher-forced figures with their 95% intervals, and a check
that no plan passes at one size and warns or fails at another ("cannot tell" at a smaller size is
allowed: a larger sample may settle it either way).

Plans: bf16, int8-bf16, int8-bf16 with an int8 head, llama.cpp Q8_0 (a requantization of the
shipped Q4_1 GGUF), llama.cpp as shipped (Q4_1: SmolLM2's fp32 weights are that file dequantized,
so it sits near zero KL), a Q4_0 requantization, OpenVINO int8; and a deliberately broken plan
(FAULT INJECTED: every RMSNorm weight x1.05, tests/faults) that must fail with its interval clear
of the warn line. Quality is not timed, so the machine's noise does not move these figures; each
verify is a fresh process (the fp32 reference's top-k is cached per model and sample).

    python benchmarks/verify_intervals.py                       # 8 plans x 3 sizes (~1 h on 2 AVX2 cores)
    python benchmarks/verify_intervals.py --plans bf16 --sizes 16,48

Writes benchmarks/results/verify_intervals.{txt,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import cpu_line, cpu_record

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
FAULTS = ROOT / "tests" / "faults"
FAULTY = "baseline+rmsnorm-scale:1.05"  # the baseline plan with the injected fault
PLANS = (
    "bf16",
    "int8-bf16",
    "int8-bf16[quantize_head=true]",
    "llamacpp[llama_quant=q8_0]",
    "llamacpp",
    "llamacpp[llama_quant=q4_0]",
    "openvino-int8",
    FAULTY,
)
FIGURES = ("mean_kl", "p99_kl", "top1_agreement", "perplexity_ratio")


def verify(plan: str, samples: int, out: Path, new_tokens: int) -> dict:
    env = dict(os.environ)
    name = plan
    if plan == FAULTY:
        name = "baseline"
        env["ACCELAB_TEST_FAULT"] = "rmsnorm-scale:1.05"
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FAULTS), env.get("PYTHONPATH")]))
    command = [
        sys.executable, "-m", "accelab", "verify", "smollm2-135m", "--plan", name,
        "--samples", str(samples), "--new-tokens", str(new_tokens), "--json", str(out), "--no-store",
    ]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if not out.exists():
        return {"plan": plan, "samples": samples, "error": (proc.stderr or proc.stdout)[-800:]}
    quality = json.loads(out.read_text())["quality"]
    return {
        "plan": plan,
        "samples": samples,
        "exit": proc.returncode,
        "seconds": round(time.perf_counter() - start, 1),
        "verdict": quality["verdict"],
        "possible": quality.get("possible"),
        "windows": quality["sample"]["n"],
        "positions": quality["sample"].get("positions"),
        "kl_over": quality["sample"].get("kl_over"),
        "metrics": {k: quality["metrics"].get(k) for k in FIGURES},
        "intervals": {k: quality["intervals"].get(k) for k in FIGURES},
        "rules": quality.get("rules"),
    }


def consistent(rows: list[dict]) -> str:
    """'ok' when no size passes while another warns or fails; else what contradicts."""
    certain = {r["verdict"] for r in rows if r.get("verdict") in ("pass", "warn", "fail")}
    if len(certain) > 1:
        return "CONTRADICTS: " + ", ".join(f"{r['samples']}: {r['verdict']}" for r in rows)
    return "ok"


def figure(row: dict, name: str) -> str:
    value, (low, high) = row["metrics"][name], row["intervals"][name]
    digits = 4 if name in ("mean_kl", "p99_kl") else 3
    return f"{value:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plans", default=",".join(PLANS), help="comma-separated")
    parser.add_argument("--sizes", default="16,32,64", help="--samples values (2 windows each)")
    parser.add_argument(
        "--new-tokens", type=int, default=0, help="greedy continuations (reported, not judged; 0: none, the default)"
    )
    parser.add_argument("--name", default="verify_intervals")
    parser.add_argument(
        "--append", action="store_true", help="keep the plans already in the result file (another run's), add these"
    )
    args = parser.parse_args()
    plans, sizes = args.plans.split(","), [int(s) for s in args.sizes.split(",")]
    options = f"--plans '{args.plans}' --sizes {args.sizes} --new-tokens {args.new_tokens}"
    json_path = RESULTS / f"{args.name}.json"
    earlier = json.loads(json_path.read_text()) if args.append and json_path.exists() else {}
    results: dict[str, list[dict]] = dict(earlier.get("results", {}))
    runs = [*earlier.get("reproduce", []), f"python benchmarks/verify_intervals.py {options}"]
    with tempfile.TemporaryDirectory() as tmp:
        for plan in plans:
            rows = []
            for samples in sizes:
                row = verify(plan, samples, Path(tmp) / f"{len(results)}-{samples}.json", args.new_tokens)
                rows.append(row)
                print(row_line(row), flush=True)
            results[plan] = rows
            write(args.name, results, runs)  # after each plan: an interrupted run keeps what it measured
    print((RESULTS / f"{args.name}.txt").read_text())


def row_line(row: dict) -> str:
    if "error" in row:
        return f"| {row['plan']} | {row['samples']} | error: {row['error'].splitlines()[-1][:120]} | | | | | |"
    cells = " | ".join(figure(row, name) for name in FIGURES)
    size = f"{row['samples']} ({row['windows']})"
    return f"| {row['plan']} | {size} | {row['verdict']} | {cells} | {row['seconds']} |"


def write(name: str, results: dict[str, list[dict]], runs: list[str]) -> None:
    lines = [cpu_line(), *(f"reproduce: {run}" for run in runs), ""]
    lines.append("| plan | samples (windows) | verdict | mean KL | p99 KL | top-1 agreement | perplexity ratio | s |")
    lines.append("|---|---|---|---|---|---|---|---|")
    lines += [row_line(row) for rows in results.values() for row in rows]
    checks = {plan: consistent(rows) for plan, rows in results.items()}
    lines += ["", "consistency across sizes (no pass at one size and warn / fail at another):"]
    lines += [f"- {plan}: {verdict}" for plan, verdict in checks.items()]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.txt").write_text("\n".join(lines) + "\n")
    payload = {"cpu": cpu_record(), "reproduce": runs, "results": results, "consistency": checks}
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()
