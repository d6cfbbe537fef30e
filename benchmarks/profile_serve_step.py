"""Where one continuous-batching step of the torch engine spends its time, at 1, 8 and 16
sequences decoding (SmolLM2-135M, fp32, the server's own step engine, no HTTP).

For each batch size: the step's wall time (median of `--steps` decode steps), then one
torch.profiler pass over a few steps, its operators' self CPU time grouped into attention,
the linear layers, the output layer (the vocabulary GEMM), sampling and the rest; "Python and
dispatch" is the wall time no operator accounts for (the model's Python modules, the cache
object, argument parsing). With `--py-spy`, the script runs itself under py-spy and prints the
share of samples per source file (transformers' modeling code, accelab's engine, torch).

    python benchmarks/profile_serve_step.py                 # ~2 min on 2 cores
    python benchmarks/profile_serve_step.py --py-spy --sizes 8
    python benchmarks/profile_serve_step.py --model llama-8b --plan int8-weight --sizes 1,16 --steps 3

Each size's line also gives the step against the machine's bound (the larger of bytes over the
bandwidth and FLOPs over the peak `accelab env` measured), as /metrics does.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

CATEGORIES = {  # operator name fragments -> category (first match wins)
    "attention": (
        "scaled_dot_product",
        "_flash_attention",
        "attention",
        "softmax",
        "bmm",
        "_foreach_copy",
        "index_copy",
        "index_select",
        "gather",
        "masked_fill",
        "tril",
    ),
    "output layer": ("lm_head",),
    "sampling": ("argmax", "multinomial", "topk", "sort", "cumsum"),
    "linear layers": ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "_linear_pointwise"),
}


def load(model: str, plan: str, sizes: tuple[int, ...]):
    from accelab.catalog.resolve import resolve
    from accelab.plan.plan import load_plan
    from accelab.serve.engines import build_engine
    from accelab.serve.scheduler import SchedulerConfig

    engine = build_engine(resolve(model), load_plan(plan), torch.device("cpu"), name="profile")
    # 256 positions a sequence hold the prompt and the steps: an 8B's float32 cache is 256 KB a position
    limits = SchedulerConfig(max_running=max(sizes), max_step_tokens=4096, kv_blocks=16 * max(sizes), block_size=16)
    return engine, engine.step_engine(limits)


def prefill(engine, stepper, ids: range, prompt: tuple[int, ...], *, blocks_of=None) -> list[int]:
    from accelab.serve.engines.base import SamplingParams, StepInput

    greedy = SamplingParams(max_tokens=10_000, temperature=0)
    out = stepper.step(
        [
            StepInput(
                seq_id=i,
                start=0,
                tokens=prompt,
                sample=True,
                params=greedy,
                **({} if blocks_of is None else {"blocks": blocks_of(i)}),
            )
            for i in ids
        ]
    )
    return [int(getattr(t, "token", t)) for t in out]


def decode(stepper, ids: range, tokens: list[int], start: int, *, blocks_of=None) -> list[int]:
    from accelab.serve.engines.base import SamplingParams, StepInput

    greedy = SamplingParams(max_tokens=10_000, temperature=0)
    out = stepper.step(
        [
            StepInput(
                seq_id=i,
                start=start,
                tokens=(t,),
                sample=True,
                params=greedy,
                **({} if blocks_of is None else {"blocks": blocks_of(i)}),
            )
            for i, t in zip(ids, tokens)
        ]
    )
    return [int(getattr(t, "token", t)) for t in out]


def block_tables(stepper, ids: range, length: int):
    """Block ids for sequences of up to `length` positions, when the engine stores KV in blocks."""
    size = getattr(stepper, "block_size", None)
    if size is None:
        return None
    per = -(-length // size)
    return lambda i: tuple(range((i - ids.start) * per, (i - ids.start + 1) * per))


def measure(stepper, engine, size: int, steps: int, profile_steps: int) -> dict:
    prompt = tuple(engine.prepare_chat([{"role": "user", "content": "Tell me a story about a dragon."}]).ids)
    ids = range(1000 * size, 1000 * size + size)
    blocks_of = block_tables(stepper, ids, len(prompt) + steps + profile_steps + 2)
    tokens = prefill(engine, stepper, ids, prompt, blocks_of=blocks_of)
    pos = len(prompt)
    cost = _decode_cost(stepper, ids, tokens, pos, blocks_of)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        tokens = decode(stepper, ids, tokens, pos, blocks_of=blocks_of)
        times.append(time.perf_counter() - started)
        pos += 1
    from torch.profiler import ProfilerActivity, profile, record_function

    head = engine.runnable.model.get_output_embeddings()
    regions: list = []

    def enter(module, args) -> None:
        regions.append(record_function("lm_head"))
        regions[-1].__enter__()

    def leave(module, args, output) -> None:
        regions.pop().__exit__(None, None, None)

    handles = [head.register_forward_pre_hook(enter), head.register_forward_hook(leave)]
    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(profile_steps):
            tokens = decode(stepper, ids, tokens, pos, blocks_of=blocks_of)
            pos += 1
    wall = (time.perf_counter() - started) / profile_steps
    for handle in handles:
        handle.remove()
    for i in ids:
        stepper.release(i)
    return {
        "size": size,
        "step_ms": 1000 * statistics.median(times),
        "tok_s": size / statistics.median(times),
        "profiled_step_ms": 1000 * wall,
        "split": split(prof, profile_steps, wall),
        "prompt": len(prompt),
        "bound": _bound_fraction(stepper, cost, statistics.median(times)),
        "top": prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12),
    }


def _decode_cost(stepper, ids: range, tokens: list[int], start: int, blocks_of):
    """The step's bytes read and FLOPs as the server counts them (`CostsSteps`), or None."""
    if not hasattr(stepper, "step_cost"):
        return None
    from accelab.serve.engines.base import SamplingParams, StepInput

    greedy = SamplingParams(max_tokens=10_000, temperature=0)
    blocks = (lambda i: {}) if blocks_of is None else (lambda i: {"blocks": blocks_of(i)})
    return stepper.step_cost(
        [
            StepInput(seq_id=i, start=start, tokens=(t,), sample=True, params=greedy, **blocks(i))
            for i, t in zip(ids, tokens)
        ]
    )


def _bound_fraction(stepper, cost, seconds: float) -> str:
    """The step against the machine's bound, as /metrics reports it (`accelab_step_machine_fraction`)."""
    from accelab.serve import machine_bound

    bound = machine_bound.for_device("cpu", getattr(stepper, "precision", "fp32")) if cost is not None else None
    if bound is None:
        return "no bound (run `accelab env` once)"
    least = bound.seconds(cost)
    which = "bytes" if cost.bytes_read / bound.bandwidth >= cost.flops / bound.peak_flops else "FLOPs"
    return (
        f"{100 * bound.fraction(cost, seconds):.0f}% of the machine's bound ({which}: {cost.bytes_read / 1e9:.2f} GB "
        f"at {bound.bandwidth / 1e9:.0f} GB/s, {cost.flops / 1e9:.1f} GFLOP at {bound.peak_flops / 1e9:.0f} GFLOP/s: "
        f"{1000 * least:.1f} ms at least)"
    )


def split(prof, steps: int, wall_s: float) -> dict[str, float]:
    """Milliseconds per step by category; what no operator covers is Python and dispatch."""
    out: dict[str, float] = collections.defaultdict(float)
    for event in prof.key_averages():
        if event.key == "lm_head":
            out["output layer"] += event.cpu_time_total / 1000 / steps  # the region, children included
            continue
        name = event.key
        category = next(
            (c for c, keys in CATEGORIES.items() if c != "output layer" and any(k in name for k in keys)),
            "other operators",
        )
        out[category] += event.self_cpu_time_total / 1000 / steps
    out["linear layers"] -= out["output layer"]  # the head's mm is inside its region, counted there
    out["Python and dispatch"] = max(0.0, 1000 * wall_s - sum(out.values()))
    return dict(out)


def py_spy(argv: list[str]) -> str:
    """Run this script under py-spy; the share of samples per source file, biggest first."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "stacks.txt"
        subprocess.run(
            [
                exe,
                "record",
                "--format",
                "raw",
                "--rate",
                "200",
                "--output",
                str(out),
                "--",
                sys.executable,
                __file__,
                *argv,
            ],
            check=True,
            capture_output=True,
        )
        return summarize_stacks(out.read_text())


def summarize_stacks(raw: str) -> str:
    """raw: py-spy's collapsed stacks ('frame;frame;... count'). Share of samples whose innermost
    Python frame is in each file, for the samples inside the engine's step."""
    by_file: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if "step (" not in stack:
            continue
        frames = stack.split(";")
        leaf = frames[-1]
        where = leaf[leaf.find("(") + 1 : leaf.rfind(":")] if "(" in leaf else leaf
        by_file[_short(where)] += int(count)
        total += int(count)
    lines = [f"  {100 * n / total:5.1f}%  {name}" for name, n in by_file.most_common(15)]
    return f"py-spy, innermost frame of {total} samples inside the step:\n" + "\n".join(lines)


def _short(path: str) -> str:
    for marker in ("site-packages/", "src/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,8,16")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--plan", default="baseline")
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="a catalog model (llama-1b: the GEMM-bound regime; llama-8b: with an int8 plan)",
    )
    parser.add_argument("--py-spy", action="store_true", help="run under py-spy and summarise its samples")
    parser.add_argument("--no-tables", action="store_true")
    opts = parser.parse_args()
    if opts.py_spy:
        argv = [a for a in sys.argv[1:] if a != "--py-spy"] + ["--no-tables"]
        print(py_spy(argv))
        return 0
    sizes = tuple(int(s) for s in opts.sizes.split(","))
    engine, stepper = load(opts.model, opts.plan, sizes)
    print(f"engine: {stepper.name}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    try:
        for size in sizes:
            row = measure(stepper, engine, size, opts.steps, opts.profile_steps)
            parts = ", ".join(f"{k} {v:.1f}" for k, v in sorted(row["split"].items(), key=lambda kv: -kv[1]))
            print(
                f"\n{size} sequences (prompt {row['prompt']} tokens): step {row['step_ms']:.1f} ms = "
                f"{row['tok_s']:.1f} tok/s, {row['bound']}; under the profiler {row['profiled_step_ms']:.1f} ms: "
                f"{parts} (ms/step)"
            )
            if not opts.no_tables:
                print(row["top"])
    finally:
        stepper.close()
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
