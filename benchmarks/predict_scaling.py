"""Data-parallel scaling of `accelab predict` on this machine: 1 process against N, same data, one run.

    python benchmarks/predict_scaling.py                       # minilm-l6, 2000 sentences, 1 vs 2 processes
    python benchmarks/predict_scaling.py --model vit-tiny --items 600

Each configuration is a real `accelab predict` command (printed, so any row can be rerun alone)
over the same inputs, with the machine's cores shared out: threads per process = cores / nproc.
On a 2-core CPU that compares 1 process x 2 threads with 2 processes x 1 thread: the same cores,
so the ratio is not "more hardware" but how well one process uses 2 threads (intra-op parallelism
in each matmul, with a barrier per operator) against two independent processes (no barriers,
but two copies of the model and two input pipelines). A third row, 1 process x 1 thread, measures
that thread scaling directly. items/s is the steady loop (model load and start-up excluded; they
are shown apart, as they dominate short runs and torchrun adds its own).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table


def write_inputs(task: str, items: int, root: Path) -> Path:
    from accelab.catalog import inputs

    if task in ("image-classification", "image-text-to-text"):
        folder = root / "images"
        for i, image in enumerate(inputs.photos(items)):
            image.thumbnail((256, 256))
            (folder / f"part{i % 4}").mkdir(parents=True, exist_ok=True)
            image.save(folder / f"part{i % 4}" / f"{i:05d}.jpg", quality=90)
        return folder
    path = root / "texts.jsonl"
    texts = inputs.prompts(items) if task == "text-generation" else inputs.sentences(items)
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    return path


def predict_command(args: argparse.Namespace, source: Path, out: Path, nproc: int, threads: int) -> list[str]:
    cmd = [
        "accelab",
        "predict",
        args.model,
        "--inputs",
        str(source),
        "--out",
        str(out),
        "--nproc",
        str(nproc),
        "--threads",
        str(threads),
        "--no-progress",
        "--overwrite",
        "--json",
        str(out.with_suffix(".result.json")),
        "--tag",
        "predict-scaling",
    ]
    if args.max_length:
        cmd += ["--max-length", str(args.max_length)]
    if args.batch_size:
        cmd += ["--batch-size", str(args.batch_size)]
    if not args.store:
        cmd.append("--no-store")
    return cmd


def run(cmd: list[str]) -> dict:
    argv = [sys.executable, "-m", "accelab.predict", *cmd[2:]]  # same interpreter as this script
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    out = Path(cmd[cmd.index("--json") + 1])
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="minilm-l6")
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--nproc", type=int, default=2, help="processes of the data-parallel row")
    parser.add_argument("--max-length", type=int, default=64, help="texts only")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--no-reference", action="store_true", help="skip the 1 process x 1 thread row")
    parser.add_argument("--store", action="store_true", help="append the runs to the results store")
    args = parser.parse_args()

    from accelab.catalog.resolve import resolve
    from accelab.plan.techniques.system import available_cpus

    task = resolve(args.model).task
    if task not in ("feature-extraction", "text-generation"):
        args.max_length = None
    cores = available_cpus()
    rows = [(1, cores), (args.nproc, max(1, cores // args.nproc))]
    if not args.no_reference:
        rows.append((1, max(1, cores // args.nproc)))
    console = Console(width=None if sys.stdout.isatty() else 130)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="predict-scaling-") as tmp:
        source = write_inputs(task, args.items, Path(tmp))
        results = []
        for nproc, threads in rows:
            cmd = predict_command(args, source, Path(tmp) / f"out-{nproc}x{threads}.jsonl", nproc, threads)
            console.print(f"[dim]$ {shlex.join(cmd)}[/]")
            results.append(((nproc, threads), run(cmd)))
    load_after = os.getloadavg()[0]
    report(console, args, task, cores, results, (load_before, load_after))


def explain(by: dict, results: list, cores: int, load: float) -> list[str]:
    """What limits the ratio, from the measured rows (not from a recipe)."""
    (one_key, _), (dp_key, _) = results[0], results[1]
    one, dp = by[one_key], by[dp_key]
    cores_line = (
        f"The cores: every row uses all {cores} of them, so {dp_key[0]} processes can reach at most "
        f"~{dp_key[0]}x one single-thread process; they gain over 1 process x {one_key[1]} threads only as "
        "far as threads scale worse than processes. The cost of processes: a model copy each (peak RSS) "
        "and a start-up each (torchrun, imports, model load)."
    )
    lines = [cores_line]
    if len(results) > 2:
        single = by[results[2][0]]
        scaling = one / single
        lines.append(
            f"Threads: 1 process went from {single:.1f} items/s with 1 thread to {one:.1f} with "
            f"{one_key[1]} ({scaling:.2f}x). Processes: {dp_key[0]} x 1 thread gave {dp / single:.2f}x "
            "over 1 x 1."
        )
        if scaling < 1:
            lines.append(
                "More threads were slower: every operator ends with the threads waiting for each other, "
                "and when other work holds the cores (load above the core count) one descheduled thread "
                "stalls the rest at each barrier; single-thread processes have no such barrier."
            )
        if dp / single < 0.8 * dp_key[0]:
            lines.append(
                f"The processes got less than {dp_key[0]} cores' worth of CPU (see CPU busy): the machine "
                "is shared, so their ratio is bounded by the CPU time they were given, not by the code."
            )
    if load > cores:
        lines.append(
            f"Load average {load:.1f} on {cores} cores: other processes shared the CPU during the run; "
            "compare ratios from one run, and rerun on an idle machine for clean figures."
        )
    lines.append("On GPUs the same command runs one process per GPU (NCCL), and the ratio is at best the GPU count.")
    return lines


def report(console: Console, args: argparse.Namespace, task: str, cores: int, results: list, load: tuple) -> None:
    base = results[0][1]["metrics"]["items_per_s"]
    table = Table(
        title=f"predict scaling · {args.model} ({task}) · {args.items} items · {cores} CPU cores", title_justify="left"
    )
    for column in (
        "processes x threads",
        "items/s",
        "vs 1 process",
        "per process items/s",
        "computing",
        "waiting on data",
        "CPU busy",
        "peak RSS / process",
        "start-up + load",
    ):
        table.add_column(column, justify="left" if column.startswith("processes") else "right")
    for (nproc, threads), result in results:
        m = result["metrics"]
        table.add_row(
            f"{nproc} x {threads}",
            f"{m['items_per_s']:.1f}",
            f"{m['items_per_s'] / base:.2f}x",
            ", ".join(f"{v:.1f}" for v in m["per_process_items_per_s"]),
            f"{m['compute_fraction']:.0%}",
            f"{m['wait_fraction']:.0%}",
            f"{m['cpu_util_fraction'] * len(m['ranks']):.0%}",
            f"{m['peak_rss_mb_max']:.0f} MiB",
            f"{m['total_wall_s'] - m['wall_s']:.1f} s",
        )
    console.print(table)
    by = {key: r["metrics"]["items_per_s"] for key, r in results}
    (_, threads_dp) = results[1][0]
    one, dp = by[results[0][0]], by[results[1][0]]
    nproc = results[1][0][0]
    console.print(
        f"{nproc} processes x {threads_dp} thread(s) / 1 process x {cores} threads = [bold]{dp / one:.2f}x[/] "
        f"on the same {cores} cores (machine load average {load[0]:.1f} before, {load[1]:.1f} after)."
    )
    for line in explain(by, results, cores, max(load)):
        console.print(f"- {line}")
    console.print(
        f"reproduce: python benchmarks/predict_scaling.py --model {args.model} --items {args.items} "
        f"--nproc {args.nproc}" + (f" --max-length {args.max_length}" if args.max_length else "")
    )


if __name__ == "__main__":
    main()
