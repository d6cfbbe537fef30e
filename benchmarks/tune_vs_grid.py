"""tune against the exhaustive grid over the same space, in one run.

For each model: every (plan, batch) of the space measured with full-length runs (the grid),
then `accelab tune`'s search over the same space, which first prunes what the capability report
expects slower than fp32 eager here, as `accelab tune` does on its default space (the grid keeps
every plan, so a wrong pruning would show as a missed best). Prints the best throughput each
found and the measurement time each spent (the wall time of all measuring child processes). The tuner is
worth it when its winner is within 5% of the grid's best at <= 40% of the grid's time.
"Within 5%" is judged like with like: when tune picks the grid's best plan the two are the same
plan; when it picks another, both plans are measured again side by side (alternating, three
times each, not counted in either time) and their medians compared. The figures of the separate runs
are printed too; they differ by the machine's drift between the two phases.
Each phase compiles into its own fresh inductor cache, so neither reuses the other's kernels
(a compiled plan costs each what it costs a first-time user).

    python benchmarks/tune_vs_grid.py [--models minilm-l6,smollm2-135m] [--quality off]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator

from rich.console import Console

from accelab.catalog.resolve import resolve
from accelab.measure.hardware import hardware_limits
from accelab.scenarios.workload import Workload
from accelab.tuner.measure import BenchMeasurer
from accelab.tuner.search import Candidate, Constraints, Search, score
from accelab.tuner.space import ladder, search_space

SPACES = {
    "minilm-l6": dict(
        variants=["baseline", "bf16-autocast", "int8-dynamic", "compile"],
        max_batch=64,
        screen=8,
        workload=Workload(scenario="forward", seq_len=128, min_seconds=2.0),
    ),
    "smollm2-135m": dict(
        variants=["baseline", "bf16-autocast", "static-cache", "int8-weight"],
        max_batch=32,
        screen=4,
        workload=Workload(scenario="generate", new_tokens=32, min_seconds=2.0),
    ),
}


def measurer(spec, workload, console, quality):
    from accelab.quality.collect import QualityConfig

    qc = QualityConfig(samples=8, new_tokens=16) if quality != "off" else None
    return BenchMeasurer(
        spec=spec,
        workload=workload,
        device=None,
        store=None,
        group_id=f"bench-{time.time():.0f}",
        quality=qc,
        tolerance=quality if quality != "off" else "balanced",
        screen_seconds=1.0,
        final_seconds=workload.min_seconds,
        console=console,
    )


@contextlib.contextmanager
def fresh_compile_cache() -> Iterator[None]:
    """The measuring children (they inherit the environment) compile into an empty cache."""
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="accelab-inductor-") as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        try:
            yield
        finally:
            if old is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = old


def run_grid(spec, space, console, quality):
    m = measurer(spec, space["workload"], console, quality)
    constraints = Constraints(quality=quality)
    results = [
        m(Candidate(variant=v, batch_size=b), "final") for v in space["variants"] for b in ladder(space["max_batch"])
    ]
    feasible = [r for r in results if constraints.violation(r) is None]
    best = max(feasible, key=lambda r: score(r, "throughput"))
    return best, sum(r.seconds for r in results), len(results)


def head_to_head(spec, space, console, quality, a, b, rounds: int = 3) -> tuple[float, float]:
    """Median throughput of candidates a and b, measured alternately `rounds` times each."""
    m = measurer(spec, space["workload"], console, quality)
    runs = {a.key: [], b.key: []}
    for _ in range(rounds):
        for c in (a, b):
            runs[c.key].append(m(c, "final").throughput)
    med = {k: statistics.median(v) for k, v in runs.items()}
    return med[a.key], med[b.key]


def run_tuner(spec, space, console, quality):
    """tune as `accelab tune` runs it on its default space (here cut to the grid's variants): it
    first leaves out what the capability report expects slower than fp32 eager on this machine.
    The hardware limits that report reads are measured once per machine (`accelab env`); the
    time to read them, or to measure them when nothing is cached, is counted as tune's."""
    t0 = time.perf_counter()
    hardware_limits("cpu")
    space_s = time.perf_counter() - t0
    found = search_space(
        spec, space["workload"].scenario, None, max_batch=space["max_batch"], include=space["variants"], prune_slow=True
    )
    for name, why in found.pruned.items():
        console.print(f"  [dim]not searched: {name}: {why}[/]")
    m = measurer(spec, space["workload"], console, quality)
    log = Search(
        variants=found.variants,
        batch_sizes=found.batch_sizes,
        measure=m,
        constraints=Constraints(quality=quality),
        screen_batch=space["screen"],
    ).run()
    return log.winner, log.measured_seconds + space_s, len(log.measurements)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="minilm-l6,smollm2-135m")
    parser.add_argument("--quality", default="off", choices=["off", "strict", "balanced", "loose"])
    args = parser.parse_args()
    console = Console(stderr=True)
    lines = []
    for name in args.models.split(","):
        spec, space = resolve(name), SPACES[name]
        console.print(f"[bold]{name}: grid[/]")
        with fresh_compile_cache():
            grid_best, grid_s, grid_n = run_grid(spec, space, console, args.quality)
        console.print(f"[bold]{name}: tune[/]")
        with fresh_compile_cache():
            tune_best, tune_s, tune_n = run_tuner(spec, space, console, args.quality)
        if tune_best.candidate == grid_best.candidate:
            ratio, how = 1.0, "the same plan"
        else:
            console.print(f"[bold]{name}: {tune_best.candidate.key} against {grid_best.candidate.key}, side by side[/]")
            t, g = head_to_head(spec, space, console, args.quality, tune_best.candidate, grid_best.candidate)
            ratio, how = t / g, f"side by side {t:.4g} vs {g:.4g}/s"
        share = tune_s / grid_s
        ok = ratio >= 0.95 and share <= 0.40
        lines.append(
            f"{name}: grid best {grid_best.candidate.key} {grid_best.throughput:.4g}/s in {grid_s:.0f} s "
            f"({grid_n} runs); "
            f"tune {tune_best.candidate.key} {tune_best.throughput:.4g}/s in {tune_s:.0f} s ({tune_n} runs); "
            f"tune's pick / grid's best {ratio:.3f} ({how}), time {share:.0%} -> {'OK' if ok else 'MISSED'}"
        )
    print("\n".join(lines))
    print(f"reproduce: python {' '.join(sys.argv)}")


if __name__ == "__main__":
    main()
