"""The blog-post table on this CPU: each technique against the fp32 eager baseline, side by side.

In one run, every row measured by accelab's own bench children (with the quality guard):
- SmolLM2-135M greedy decoding at batch 1 and at batch 16 (speed-ups against batch-1 fp32 eager);
- MiniLM-L6 embeddings at batch 32, seq 128.
Prints tokens/s (or items/s), the ratio to the baseline, the roofline fraction and the quality
verdict of every plan, then the best passing plan of each group.

    python benchmarks/techniques_cpu.py [--quick] [--skip-compile]
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from accelab.benchmark.compare import run_compare
from accelab.catalog.resolve import resolve
from accelab.plan.plan import load_plan
from accelab.quality.collect import QualityConfig
from accelab.results import compare_table
from accelab.scenarios.workload import Workload

GROUPS = {
    "smollm2-b1": dict(
        title="smollm2-135m decode, batch 1",
        model="smollm2-135m",
        workload=Workload(scenario="generate", batch_size=1, new_tokens=32, min_seconds=4, min_iters=3),
        plans=[
            "baseline",
            "bf16-autocast",
            "bf16",
            "static-cache",
            "compile-static",
            "int8-weight",
            "int8-weight-compile",
        ],
        compile_plans={"compile-static", "int8-weight-compile"},
    ),
    "smollm2-b16": dict(
        title="smollm2-135m decode, batch 16",
        model="smollm2-135m",
        workload=Workload(scenario="generate", batch_size=1, new_tokens=32, min_seconds=4, min_iters=3),
        plans=[
            "baseline",
            "baseline[batch_size=16]",
            "bf16-autocast[batch_size=16]",
            "bf16[batch_size=16]",
            "static-cache[batch_size=16]",
            "compile-static[batch_size=16]",
        ],
        compile_plans={"compile-static[batch_size=16]"},
    ),
    "minilm-b32": dict(
        title="minilm-l6 embeddings, batch 32, seq 128",
        model="minilm-l6",
        workload=Workload(scenario="forward", batch_size=32, seq_len=128, min_seconds=4, min_iters=5),
        plans=["baseline", "bf16-autocast", "bf16", "compile", "int8-dynamic", "int8-weight-compile"],
        compile_plans={"compile", "int8-weight-compile"},
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--skip-compile", action="store_true", help="Leave out compiled plans (each compiles ~1-2 min)."
    )
    parser.add_argument(
        "--groups", default=",".join(GROUPS), help=f"Comma-separated groups to run, of {', '.join(GROUPS)}."
    )
    args = parser.parse_args()
    console = Console(width=170)
    summary = []
    for key in [g.strip() for g in args.groups.split(",") if g.strip()]:
        if key not in GROUPS:
            parser.error(f"unknown group {key!r}; choose from {', '.join(GROUPS)}")
        group = GROUPS[key]
        title = group["title"]
        names = [p for p in group["plans"] if not (args.skip_compile and p in group["compile_plans"])]
        spec = resolve(group["model"])
        quality = QualityConfig(samples=8, new_tokens=16, batch_size=8)
        results = run_compare(spec, [load_plan(n) for n in names], group["workload"], quality=quality, console=console)
        compare_table.render(results, title=f"{title} (speed-up against {names[0]})", console=console)
        rows = compare_table.rows(results)
        passing = [r for r in rows[1:] if r["status"] == "ok" and r["quality"] in ("pass", "warn") and r["speedup"]]
        best = max(passing, key=lambda r: r["speedup"], default=None)
        if best:
            roof = f", roofline {best['roofline'] * 100:.0f}%" if best.get("roofline") else ""
            summary.append(
                f"{title}: best passing plan {best['plan']} at {best['speedup']:.2f}x the baseline "
                f"({best['throughput']:.4g} {best['throughput_unit']}{roof}; quality {best['quality']})"
            )
        else:
            summary.append(f"{title}: no plan beat the baseline with passing quality")
    print("\n".join(summary))
    print(f"reproduce: python {' '.join(sys.argv)}")


if __name__ == "__main__":
    main()
