"""Does the harness change what it measures? accelab bench against a plain hand-timed loop.

Both time MiniLM-L6 forward at batch 8, seq 128 on the same real inputs, alternating
(plain, accelab, plain, accelab, ...) so that machine noise hits both alike. Prints each p50 and
the ratio; the harness is transparent when the ratio is within 5% of 1.

    python benchmarks/harness_overhead.py [--rounds 3] [--model minilm-l6]

The printout is also saved, as the other benchmarks' are, to benchmarks/results/harness_overhead.txt
(and a JSON beside it; --out moves them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from machine import cpu_line, cpu_record


def plain_loop(model_name: str, batch_size: int, seq_len: int, iters: int, threads: int) -> float:
    """The loop a person would write by hand: load, warm up, time each call, take the median."""
    from accelab.catalog import inputs
    from accelab.catalog.load import load
    from accelab.catalog.resolve import resolve

    torch.set_num_threads(threads)
    loaded = load(resolve(model_name))
    batch = inputs.forward_batch(loaded, batch_size, seq_len=seq_len)
    with torch.inference_mode():
        for _ in range(3):
            loaded.model(**batch)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            loaded.model(**batch)
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def accelab_bench(model_name: str, batch_size: int, seq_len: int, iters: int, threads: int) -> float:
    from accelab.benchmark.engine import bench
    from accelab.catalog.resolve import resolve
    from accelab.plan.plan import Plan
    from accelab.scenarios.workload import Workload

    workload = Workload(
        scenario="forward", batch_size=batch_size, seq_len=seq_len, warmup=3, min_iters=iters, min_seconds=0
    )
    result = bench(resolve(model_name), Plan(name="baseline", threads=threads), workload)
    if not result.ok:
        raise SystemExit(f"accelab bench failed: {result.reason}")
    return result.metrics["latency_ms"]["p50"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="minilm-l6")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "harness_overhead.txt")
    args = parser.parse_args()
    lines: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    say(cpu_line())

    from multiprocessing import get_context

    plain, harness = [], []
    ctx = get_context("spawn")
    for r in range(args.rounds):
        # the plain loop also runs in a fresh process, so both start from the same state
        with ctx.Pool(1) as pool:
            plain.append(pool.apply(plain_loop, (args.model, args.batch_size, args.seq_len, args.iters, args.threads)))
        harness.append(accelab_bench(args.model, args.batch_size, args.seq_len, args.iters, args.threads))
        say(f"round {r + 1}: plain p50 {plain[-1]:.2f} ms, accelab bench p50 {harness[-1]:.2f} ms")
    ratio = statistics.median(harness) / statistics.median(plain)
    say()
    say(f"{args.model} forward batch {args.batch_size} seq {args.seq_len}, {args.threads} threads")
    say(f"plain loop p50 (median of rounds): {statistics.median(plain):.2f} ms")
    say(f"accelab bench p50 (median of rounds): {statistics.median(harness):.2f} ms")
    say(f"ratio accelab / plain: {ratio:.3f}  ({'within' if abs(ratio - 1) <= 0.05 else 'OUTSIDE'} 5%)")
    say(f"reproduce: python {' '.join(sys.argv)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    args.out.with_suffix(".json").write_text(
        json.dumps(
            {
                "cpu": cpu_record(),
                "model": args.model,
                "batch_size": args.batch_size,
                "seq_len": args.seq_len,
                "threads": args.threads,
                "plain_p50_ms": plain,
                "accelab_p50_ms": harness,
                "ratio": ratio,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
