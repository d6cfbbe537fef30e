"""Alternative runtimes against fp32 eager torch on this CPU, each row with its quality verdict.

In one run, every number measured by accelab's own bench children (`accelab.benchmark.engine.bench`,
what `accelab compare` runs per plan) with the quality guard against the fp32 eager reference:
- minilm-l6 embeddings, seq 128, batch 1 and batch 32: torch eager vs ONNX Runtime (plain,
  transformer-fused, int8 dynamic), OpenVINO (f32, bf16);
- smollm2-135m greedy decoding at batch 1: torch eager vs llama.cpp on the catalog's Q4_1 GGUF,
  as it is and requantised to Q4_0 (llama_quant);
- vit-base classification at batch 1 and 8 through ONNX Runtime and OpenVINO.
The machine is shared, so every group runs `--rounds` times with the plan order reversed every
other round, and a ratio is always taken against the baseline of the same round. A CPU witness
records how many CPUs other processes used during each measurement; rounds above
`--max-foreign` are left out of the medians when a quieter round exists (the table says how
many rounds it used). Then it checks the targets:
best passing minilm plan >= 1.5x eager at batch 1 and >= 1.15x at batch 32; llama.cpp >= 4x eager
tokens/s at batch 1. And each fusion against the plan without it, round by round (FUSION_PAIRS):
a fusion "beats" its unfused plan when it is faster in every round.

    python benchmarks/backends_cpu.py [--rounds 3] [--groups minilm-b1,minilm-b32,smollm2,vit-b1,vit-b8]
"""

from __future__ import annotations

import argparse
import json
import resource
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
from machine import cpu_line, cpu_record
from rich.console import Console
from rich.table import Table

from accelab.benchmark.engine import bench
from accelab.catalog.resolve import resolve
from accelab.plan.plan import Plan
from accelab.quality.collect import QualityConfig
from accelab.scenarios.workload import Workload


def plan(name: str, backend: str = "torch", **options: str) -> Plan:
    return Plan(name=name, backend=backend, backend_options=tuple(sorted(options.items())))


BASELINE = plan("baseline")
GRAPH_PLANS = [
    BASELINE,
    plan("onnxruntime-unfused", "onnxruntime", ort_opt_level="1"),  # basic graph passes: no transformer fusions
    plan("onnxruntime", "onnxruntime"),  # level 99: ORT's own C++ fusions (LayerNorm, Gelu, MatMul+scale)
    plan("onnxruntime-fused", "onnxruntime", ort_fusion="on"),  # + ORT's Python transformer optimizer (Attention)
    plan("ort-int8", "onnxruntime", ort_quant="int8-dynamic"),  # int8 without the transformer optimizer
    plan("ort-fused-int8", "onnxruntime", ort_fusion="on", ort_quant="int8-dynamic"),
    plan("ort-fused-int8-fullrange", "onnxruntime", ort_fusion="on", ort_quant="int8-dynamic", ort_reduce_range="off"),
    plan(
        "ort-fused-int8-matmul",
        "onnxruntime",
        ort_fusion="on",
        ort_quant="int8-dynamic",
        ort_quant_ops="matmul",
        ort_reduce_range="off",
    ),
    plan("openvino", "openvino"),
    plan("openvino-bf16", "openvino", ov_precision="bf16"),
]
LLM_PLANS = [
    BASELINE,
    plan("llamacpp", "llamacpp"),  # the catalog's Q4_1 GGUF as it is
    plan("llamacpp-q4_0", "llamacpp", llama_quant="q4_0"),  # requantised: AVX512 repacked Q4_0 kernels
    plan("llamacpp-q4_0-pure", "llamacpp", llama_quant="q4_0-pure"),  # the tied embedding in Q4_0 too
    plan("llamacpp-1thread", "llamacpp", llama_threads="1"),  # what a busy 2-core machine leaves
]


@dataclass(frozen=True, kw_only=True, slots=True)
class Group:
    model: str
    workload: Workload
    plans: list[Plan]
    target: float | None = None  # best passing plan must reach this ratio
    unit: str = "items/s"


def groups(min_seconds: float, threads: int | None = None, only: set[str] | None = None) -> dict[str, Group]:
    graph_plans = [p.with_changes(threads=threads) for p in GRAPH_PLANS if not only or p.name in only or p is BASELINE]
    llm_plans = [p.with_changes(threads=threads) for p in LLM_PLANS if threads is None or p.name != "llamacpp-1thread"]
    forward = dict(scenario="forward", seq_len=128, min_iters=5, min_seconds=min_seconds, warmup=2)
    return {
        "minilm-b1": Group(
            model="minilm-l6", workload=Workload(batch_size=1, **forward), plans=graph_plans, target=1.5
        ),
        "minilm-b32": Group(
            model="minilm-l6", workload=Workload(batch_size=32, **forward), plans=graph_plans, target=1.15
        ),
        "smollm2": Group(
            model="smollm2-135m",
            unit="tokens/s",
            plans=llm_plans,
            target=4.0,
            workload=Workload(
                scenario="generate", batch_size=1, new_tokens=64, min_iters=3, min_seconds=min_seconds, warmup=1
            ),
        ),
        "vit-b1": Group(model="vit-base", workload=Workload(batch_size=1, **forward), plans=graph_plans),
        "vit-b8": Group(model="vit-base", workload=Workload(batch_size=8, **forward), plans=graph_plans),
    }


class CpuWitness:
    """CPU time other processes used while a block ran, in CPUs (CPU seconds per wall second).

    System-wide busy time (steal included: other VMs) minus what this process and its finished
    children used. A measurement taken while it is high says more about the neighbours."""

    def __enter__(self) -> CpuWitness:
        self.start, self.busy, self.ours = time.perf_counter(), _busy_seconds(), _our_seconds()
        self.foreign = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self.start
        used = (_busy_seconds() - self.busy) - (_our_seconds() - self.ours)
        self.foreign = max(used, 0.0) / max(wall, 1e-9)


def wait_for_quiet(max_foreign: float, timeout_s: float, console: Console) -> None:
    """Sleep (in 5 s looks) until other processes use at most max_foreign CPUs, or timeout_s passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with CpuWitness() as witness:
            time.sleep(5)
        if witness.foreign <= max_foreign:
            return
        console.print(f"[dim]waiting for a quieter machine: other processes use {witness.foreign:.2f} CPUs[/]")


def _busy_seconds() -> float:
    t = psutil.cpu_times()
    return sum(getattr(t, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq", "steal"))


def _our_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@dataclass(frozen=True, kw_only=True, slots=True)
class Sample:
    ratio: float | None  # against the baseline of the same round
    rate: float
    foreign: float  # other processes' CPUs during this measurement and its round's baseline
    extra: dict


@dataclass(kw_only=True)
class Row:
    name: str
    samples: list[Sample] = field(default_factory=list)
    verdict: str = "-"
    rules: list[str] = field(default_factory=list)  # the quality rules that did not pass
    status: str = "ok"
    reason: str = ""

    def used(self, max_foreign: float) -> list[Sample]:
        """The quiet rounds' samples, or every sample when no round was quiet."""
        quiet = [s for s in self.samples if s.foreign <= max_foreign]
        return quiet or self.samples

    def median(self, max_foreign: float) -> Sample | None:
        samples = sorted((s for s in self.used(max_foreign) if s.ratio is not None), key=lambda s: s.ratio)
        return samples[(len(samples) - 1) // 2] if samples else None  # a real sample, with its extras


def run_group(
    title: str, group: Group, rounds: int, console: Console, *, max_foreign: float = 0.3, wait_s: float = 0.0
) -> list[Row]:
    spec = resolve(group.model)
    rows = {p.name: Row(name=p.name) for p in group.plans}
    for r in range(rounds):
        # the baseline always runs first; the others alternate direction, so drift hits them alike
        order = [group.plans[0], *(group.plans[1:] if r % 2 == 0 else group.plans[:0:-1])]
        quality = QualityConfig(samples=16, new_tokens=16, batch_size=8) if r == 0 else None  # verdicts once
        wait_for_quiet(max_foreign, wait_s, console)
        console.print(f"[bold]{title}[/] round {r + 1}/{rounds}")
        base_rate, base_foreign = None, 0.0
        for plan in order:
            with CpuWitness() as witness:
                result = bench(spec, plan, group.workload, kind="compare", quality=quality)
            row = rows[plan.name]
            if result.status != "ok":
                row.status, row.reason = result.status, (result.reason or "").splitlines()[0][:150]
                continue
            m = result.metrics
            if plan is group.plans[0]:
                base_rate, base_foreign = m["throughput"], witness.foreign
            extra = {}
            if group.workload.scenario == "generate":
                extra = {"ttft_ms": m["ttft_ms"]["p50"], "tpot_ms": m.get("tpot_ms", {}).get("p50")}
            row.samples.append(
                Sample(
                    ratio=m["throughput"] / base_rate if base_rate else None,
                    rate=m["throughput"],
                    foreign=max(witness.foreign, base_foreign),
                    extra=extra,
                )
            )
            if result.quality:
                row.verdict = result.quality["verdict"]
                row.rules = [line for line in result.quality["rules"] if line.split()[1] != "pass"]
            console.print(
                f"  {plan.name}: {m['throughput']:.1f} {group.unit}, other processes used "
                f"{witness.foreign:.2f} CPUs meanwhile"
            )
    return list(rows.values())


# (fused plan, the same plan without that fusion)
FUSION_PAIRS = [
    ("onnxruntime", "onnxruntime-unfused"),
    ("onnxruntime-fused", "onnxruntime-unfused"),
    ("onnxruntime-fused", "onnxruntime"),
    ("ort-fused-int8", "ort-int8"),
]


def fusion_checks(title: str, rows: list[Row], console: Console, max_foreign: float = 0.3) -> list[dict]:
    """Each fused plan against its unfused one, per round (the same round's two runs), over the
    rounds in which neither run shared the machine (all rounds when none was quiet)."""
    by_name = {r.name: r for r in rows}
    out = []
    for fused, plain in FUSION_PAIRS:
        a, b = by_name.get(fused), by_name.get(plain)
        if a is None or b is None or a.status != "ok" or b.status != "ok":
            continue
        pairs = list(zip(a.samples, b.samples))
        quiet = [(x, y) for x, y in pairs if max(x.foreign, y.foreign) <= max_foreign]
        used = quiet or pairs
        ratios = sorted(x.rate / y.rate for x, y in used)
        median = ratios[(len(ratios) - 1) // 2]
        verdict = (
            "beats it in every round"
            if ratios[0] > 1.0
            else ("slower in every round" if ratios[-1] < 1.0 else "within the rounds' noise")
        )
        rounds = f"{len(used)}/{len(pairs)} rounds{'' if quiet else ', none quiet'}"
        console.print(
            f"{title}: {fused} / {plain} = {median:.2f}x ({rounds}: {ratios[0]:.2f}-{ratios[-1]:.2f}x): {verdict}"
        )
        out.append(
            {
                "group": title,
                "fused": fused,
                "unfused": plain,
                "median": median,
                "ratios": ratios,
                "rounds_used": len(used),
                "rounds": len(pairs),
                "verdict": verdict,
            }
        )
    return out


def render(title: str, group: Group, rows: list[Row], max_foreign: float, console: Console) -> None:
    table = Table(title=f"{title}: {group.model} · {group.workload.scenario} · batch {group.workload.batch_size}")
    for column in ("plan", f"{group.unit}", "ratio vs eager", "range", "rounds used", "quality", "notes"):
        table.add_column(column)
    for row in rows:
        mid = row.median(max_foreign)
        if row.status != "ok" or mid is None:
            table.add_row(row.name, "-", "-", "-", "-", "-", f"{row.status}: {row.reason}")
            continue
        used = row.used(max_foreign)
        ratios = [s.ratio for s in used if s.ratio is not None]
        quiet = "" if any(s.foreign <= max_foreign for s in row.samples) else " (none quiet)"
        extra = ", ".join([f"{k} {v:.1f}" for k, v in mid.extra.items() if v is not None] + row.rules)
        table.add_row(
            row.name,
            f"{mid.rate:.1f}",
            f"{mid.ratio:.2f}x",
            f"{min(ratios):.2f}-{max(ratios):.2f}x",
            f"{len(used)}/{len(row.samples)}{quiet}",
            row.verdict,
            extra,
        )
    console.print(table)


def check_target(title: str, group: Group, rows: list[Row], max_foreign: float, console: Console) -> dict | None:
    if group.target is None:
        return None
    ratios = {
        r.name: r.median(max_foreign).ratio
        for r in rows[1:]
        if r.status == "ok" and r.verdict == "pass" and r.median(max_foreign)
    }
    best = max(ratios, key=ratios.get, default=None)
    met = best is not None and ratios[best] >= group.target
    line = (
        f"{title}: best passing plan {best} at {ratios[best]:.2f}x (target {group.target}x): "
        f"{'MET' if met else 'NOT MET'}"
        if best
        else f"{title}: no passing plan (target {group.target}x): NOT MET"
    )
    console.print(line)
    return {"group": title, "best": best, "ratio": ratios.get(best), "target": group.target, "met": met}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="Interleaved repeats of every group (default 3).")
    parser.add_argument("--groups", default="minilm-b1,minilm-b32,smollm2,vit-b1,vit-b8")
    parser.add_argument("--min-seconds", type=float, default=3.0, help="Timed seconds per measurement.")
    parser.add_argument(
        "--threads",
        type=int,
        help="Threads for every plan (torch intra-op, ORT, OpenVINO, "
        "llama.cpp); default: all CPUs. 1 gives steadier ratios on a busy shared machine.",
    )
    parser.add_argument(
        "--max-foreign",
        type=float,
        default=0.3,
        help="Rounds during which other processes used more CPUs than this are left out of the "
        "medians (when a quieter round exists). Default 0.3.",
    )
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="Before each round, wait up to this long for other processes to go below "
        "--max-foreign (default 0: do not wait).",
    )
    parser.add_argument("--json", type=Path, help="Write every row and the target checks here.")
    parser.add_argument("--plans", help="Only these plans of the graph groups (comma-separated; baseline always runs)")
    args = parser.parse_args()
    console = Console(width=170)
    only = {p.strip() for p in args.plans.split(",")} if args.plans else None
    all_groups = groups(args.min_seconds, args.threads, only)
    console.print(cpu_line(), markup=False, soft_wrap=True)  # one line, however long
    report: dict = {"cpu": cpu_record(), "groups": {}, "targets": [], "fusions": [], "threads": args.threads}
    for title in [g.strip() for g in args.groups.split(",") if g.strip()]:
        group = all_groups[title]
        rows = run_group(title, group, args.rounds, console, max_foreign=args.max_foreign, wait_s=args.wait_quiet)
        render(title, group, rows, args.max_foreign, console)
        report["groups"][title] = [
            asdict(r)
            | {"median": asdict(r.median(args.max_foreign) or Sample(ratio=None, rate=0, foreign=0, extra={}))}
            for r in rows
        ]
        report["fusions"] += fusion_checks(title, rows, console, args.max_foreign)
        target = check_target(title, group, rows, args.max_foreign, console)
        if target:
            report["targets"].append(target)
    console.rule("targets")
    for target in report["targets"]:
        status = "MET" if target["met"] else "NOT MET"
        console.print(
            f"{target['group']}: {target['best']} {target['ratio'] or 0:.2f}x >= {target['target']}x: {status}"
        )
    console.print("reproduce: " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
