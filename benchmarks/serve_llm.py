"""LLM serving side by side: the same model (SmolLM2-135M), the same closed-loop streaming chat
load, the same machine, in one run, served by
- accelab's continuous scheduler on torch (requests join and leave the batch at every step),
- accelab's per-batch scheduler on torch (`--scheduler static`: one generate call per batch),
- `transformers serve --continuous-batching` on the same model directory (the stock peer),
- accelab's continuous scheduler on llama.cpp (the catalog's Q4_1 GGUF).

Every server starts at once and idles while another is measured; the levels (1, 8, 16 users by
default) are measured level by level, the servers taking turns within a level, so a machine
shared with other work slows all alike. Users send greedy chat requests one after another,
each asking for max_tokens from a mix of short and long answers (16, 128, 32, 96, 64, 128, 24,
80), as real chat traffic does. Throughput counts completion tokens over the measured window;
inter-token latency is per token (from the usage counts).

Then `accelab bench --plan llamacpp` gives llama.cpp's own decode rate at batch 1 here, the
bound for the 1-user llama.cpp row, and each step engine alone (no HTTP, no scheduler)
decodes 1 and 8 sequences: the most that 8 users can gain over one on this machine. Prints the table, the targets of issue 12 with a verdict
each, and the commands that reproduce every row; saves the printout and a JSON beside it.

    python benchmarks/serve_llm.py                         # about 15 minutes on 2 CPU cores
    python benchmarks/serve_llm.py --duration 90 --users 1,8
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from accelab.catalog import inputs
from accelab.catalog.store import model_dir
from accelab.loadtest.client import LoadConfig, run_load
from accelab.loadtest.summary import SLO, summarize_run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' server harness, one copy
from serving import ServerProcess

MIX = (16, 128, 32, 96, 64, 128, 24, 80)
RESULTS = Path(__file__).parent / "results"


@dataclass
class Server:
    label: str
    kind: str  # "accelab" | "transformers"
    args: list[str]
    model: str = ""  # the id requests name
    url: str = ""
    process: Any = None
    rows: dict[int, dict[str, Any]] = field(default_factory=dict)

    def command(self, port: str = "8000") -> str:
        if self.kind == "accelab":
            args = ["accelab", "serve", *self.args[1:]]
            args[args.index("--port") + 1] = port
        else:
            args = [*self.args]
            args[args.index("--port") + 1] = port
        return shlex.join(args)


def servers(opts: argparse.Namespace) -> list[Server]:
    name = "smollm2-135m"
    common = [
        "--port",
        "0",
        "--max-batch-size",
        str(max(opts.users)),
        "--max-queue",
        "256",
        "--request-timeout",
        "600",
        "--max-tokens",
        str(max(MIX)),
    ]
    return [
        Server("accelab continuous (torch)", "accelab", ["accelab.serve", name, *common], model=name),
        Server(
            "accelab static (torch)", "accelab", ["accelab.serve", name, *common, "--scheduler", "static"], model=name
        ),
        Server(
            "transformers serve --continuous-batching",
            "transformers",
            [
                "transformers",
                "serve",
                str(model_dir(name)),
                "--continuous-batching",
                "--device",
                "cpu",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
            ],
            model=str(model_dir(name)),
        ),
        Server(
            "accelab continuous (llama.cpp)",
            "accelab",
            ["accelab.serve", name, *common, "--plan", "llamacpp"],
            model=name,
        ),
    ]


def start(server: Server) -> None:
    if server.kind == "accelab":
        server.process = ServerProcess("-m", *server.args, timeout_s=300)
        server.url = server.process.url
        return
    port = _free_port()
    args = list(server.args)
    args[args.index("--port") + 1] = str(port)
    server.args = args
    beside = Path(sys.executable).parent / args[0]  # the CLI of this environment's transformers
    args = [str(beside) if beside.exists() else args[0], *args[1:]]
    log = open(Path(tempfile.gettempdir()) / f"transformers-serve-{port}.log", "w")
    server.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    server.url = f"http://127.0.0.1:{port}"


def wait_ready(server: Server) -> None:
    if server.kind == "accelab":
        server.process.wait_ready(timeout_s=300)
        return
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.label} exited with {server.process.returncode}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"{server.label} not ready after 300 s")


def stop(server: Server) -> None:
    if server.process is None:
        return
    if server.kind == "accelab":
        server.process.stop()
    else:
        server.process.terminate()
        try:
            server.process.wait(30)
        except subprocess.TimeoutExpired:
            server.process.kill()


def measure(server: Server, users: int, opts: argparse.Namespace) -> dict[str, Any]:
    config = LoadConfig(
        url=server.url,
        endpoint="chat",
        inputs=tuple(inputs.prompts(52)),
        model=server.model,
        concurrency=users,
        duration_s=opts.duration,
        warmup=users,
        max_tokens=MIX,
        stream=True,
        timeout_s=600,
    )
    records = run_load(config, server.model)
    summary = summarize_run(records, SLO())
    return {
        "users": users,
        "requests": summary["requests"],
        "errors": summary["errors_by_status"],
        "tokens_per_s": summary["output_token_throughput"],
        "ttft_p50_ms": (summary["ttft_ms"] or {}).get("p50"),
        "ttft_p99_ms": (summary["ttft_ms"] or {}).get("p99"),
        "itl_p50_ms": (summary["itl_ms"] or {}).get("p50"),
        "e2e_p50_ms": (summary["e2e_ms"] or {}).get("p50"),
        "decode_tokens_per_s": 1000 / summary["itl_ms"]["p50"] if summary["itl_ms"] else None,
        "empty_answers": sum(1 for r in records if r.ok and r.output_tokens == 0),
    }


def llamacpp_bench_decode() -> float | None:
    """`accelab bench --plan llamacpp`: decode tokens/s at batch 1."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        cmd = [
            sys.executable,
            "-m",
            "accelab",
            "bench",
            "smollm2-135m",
            "--plan",
            "llamacpp",
            "--scenario",
            "generate",
            "--new-tokens",
            "64",
            "--json",
            str(out),
            "--no-store",
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 or not out.exists():
            print(f"  bench failed ({done.returncode}): {done.stderr[-500:]}")
            return None
        return json.loads(out.read_text())["metrics"].get("decode_tokens_per_s")


def engine_ceiling(plan: str, sizes: tuple[int, ...] = (1, 8), steps: int = 40) -> dict[int, float]:
    """Decode tokens/s of the server's step engine alone (no HTTP, no scheduler), at each batch
    size: what the engine can give 8 users at most, against one."""
    import torch

    from accelab.catalog.resolve import resolve
    from accelab.plan.plan import load_plan
    from accelab.runtimes import load_runnable
    from accelab.serve.engines import build_engine
    from accelab.serve.engines.base import SamplingParams, StepInput
    from accelab.serve.scheduler import SchedulerConfig

    engine = build_engine(load_runnable(resolve("smollm2-135m"), load_plan(plan), torch.device("cpu")), name="ceiling")
    limits = SchedulerConfig(max_running=max(sizes), max_step_tokens=4096, kv_blocks=4096, block_size=16)
    stepper = engine.step_engine(limits)
    greedy = SamplingParams(max_tokens=steps + 1, temperature=0)
    prompt = tuple(engine.prepare_chat([{"role": "user", "content": "Tell me a story."}]).ids)
    rates = {}
    try:
        for size in sizes:
            ids = range(1000 * size, 1000 * size + size)
            tokens = stepper.step(
                [StepInput(seq_id=i, start=0, tokens=prompt, sample=True, params=greedy) for i in ids]
            )
            started = time.perf_counter()
            for k in range(steps):
                tokens = stepper.step(
                    [
                        StepInput(seq_id=i, start=len(prompt) + k, tokens=(t,), sample=True, params=greedy)
                        for i, t in zip(ids, tokens)
                    ]
                )
            rates[size] = size * steps / (time.perf_counter() - started)
            for i in ids:
                stepper.release(i)
    finally:
        stepper.close()
        engine.close()
    return rates


def fmt(value: Any, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def report(
    all_servers: list[Server], bench_tps: float | None, ceilings: dict[str, dict[int, float]], opts: argparse.Namespace
) -> str:
    lines = [
        f"SmolLM2-135M, closed-loop streaming chat, greedy, max_tokens cycling {','.join(map(str, MIX))}, "
        f"{opts.duration:g} s per level after a warm-up request per user, {os.cpu_count()} CPU cores",
        "",
    ]
    lines.append("| server | users | tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | e2e p50 ms | requests | errors |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for server in all_servers:
        for users, row in sorted(server.rows.items()):
            errors = row["errors"] or {}
            if row["empty_answers"]:
                errors = {**errors, "empty": row["empty_answers"]}
            lines.append(
                f"| {server.label} | {users} | {fmt(row['tokens_per_s'], 1)} | {fmt(row['ttft_p50_ms'])} | "
                f"{fmt(row['ttft_p99_ms'])} | {fmt(row['itl_p50_ms'], 1)} | {fmt(row['e2e_p50_ms'])} | "
                f"{row['requests']} | {errors or 0} |"
            )
    lines.append("")
    lines.append(f"accelab bench --plan llamacpp (decode, batch 1): {fmt(bench_tps, 1)} tok/s")
    for label, rates in ceilings.items():
        lines.append(
            f"{label} step engine alone, decode tok/s: "
            + ", ".join(f"{rate:.1f} at {size} sequence{'s' if size > 1 else ''}" for size, rate in rates.items())
            + f" ({rates[max(rates)] / rates[1]:.2f}x: the most {max(rates)} users can get over 1)"
        )
    lines.append("")
    lines += verdicts(all_servers, bench_tps)
    lines.append("")
    lines.append("reproduce a row by hand (one server, then the load):")
    for server in all_servers:
        lines.append(f"  {server.command()} &")
    lines.append(
        f"  accelab loadtest http://127.0.0.1:8000 --endpoint chat --concurrency 8 --duration {opts.duration:g} "
        f"--max-tokens {','.join(map(str, MIX))} --warmup 8"
    )
    lines.append(f"reproduce all of it: python {shlex.join(sys.argv)}")
    return "\n".join(lines)


def verdicts(all_servers: list[Server], bench_tps: float | None) -> list[str]:
    by = {s.label: s.rows for s in all_servers}
    cont, static = by["accelab continuous (torch)"], by["accelab static (torch)"]
    peer, llama = by["transformers serve --continuous-batching"], by["accelab continuous (llama.cpp)"]
    out = ["targets (issue 12):"]

    def check(text: str, ok: bool | None) -> None:
        out.append(f"  [{'n/a' if ok is None else 'OK' if ok else 'MISSED'}] {text}")

    if 8 in cont and 8 in peer:
        ratio = cont[8]["tokens_per_s"] / peer[8]["tokens_per_s"]
        check(f"torch, 8 users: {ratio:.2f}x transformers serve's tok/s (target >= 1.2x)", ratio >= 1.2)
        check(
            f"torch, 8 users: TTFT p99 {fmt(cont[8]['ttft_p99_ms'])} ms vs the peer's {fmt(peer[8]['ttft_p99_ms'])} "
            "ms (target: no worse)",
            cont[8]["ttft_p99_ms"] <= peer[8]["ttft_p99_ms"],
        )
    if 1 in cont and 1 in static:
        ratio = cont[1]["tokens_per_s"] / static[1]["tokens_per_s"]
        check(
            f"torch, 1 user: {ratio:.2f}x the per-batch server's tok/s (target: no slower, >= 0.95 within noise)",
            ratio >= 0.95,
        )
    if 8 in llama and 1 in llama:
        ratio = llama[8]["tokens_per_s"] / llama[1]["tokens_per_s"]
        check(f"llama.cpp, 8 users: {ratio:.2f}x its own 1-user tok/s (target >= 2x)", ratio >= 2)
        check(
            f"llama.cpp, 8 users: TTFT p99 {fmt(llama[8]['ttft_p99_ms'])} ms (target <= 1000 ms)",
            llama[8]["ttft_p99_ms"] <= 1000,
        )
    if 1 in llama:
        share = llama[1]["tokens_per_s"] / bench_tps if bench_tps else None
        check(
            f"llama.cpp, 1 user: {fmt(share and share * 100)}% of bench's decode tok/s (target >= 90%)",
            None if share is None else share >= 0.9,
        )
        streaming = (
            llama[1]["decode_tokens_per_s"] / bench_tps if bench_tps and llama[1]["decode_tokens_per_s"] else None
        )
        out.append(
            f"         (within a stream, 1 / ITL p50 = {fmt(llama[1]['decode_tokens_per_s'], 1)} tok/s = "
            f"{fmt(streaming and streaming * 100)}% of bench's decode rate; the served tok/s also pays each "
            "request's prefill and round trip, which bench's decode rate leaves out)"
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", default="1,8,16", help="closed-loop levels, comma-separated")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds measured per server and level")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure each level this many times, the servers in a new order each round; the median round is reported",
    )
    parser.add_argument("--out", default=str(RESULTS / "serve_llm.txt"))
    opts = parser.parse_args()
    opts.users = [int(u) for u in opts.users.split(",")]
    chosen = servers(opts)
    try:
        for server in chosen:
            print(f"starting {server.label}: {shlex.join(server.args)}", flush=True)
            start(server)
        for server in chosen:
            wait_ready(server)
        for users in opts.users:
            runs: dict[str, list[dict[str, Any]]] = {s.label: [] for s in chosen}
            for round_ in range(opts.rounds):
                order = chosen[round_ % len(chosen) :] + chosen[: round_ % len(chosen)]  # a new order each round
                for server in order:
                    row = measure(server, users, opts)
                    runs[server.label].append(row)
                    print(
                        f"  {server.label:<42} {users:>2} users: {row['tokens_per_s']:6.1f} tok/s, TTFT p50 "
                        f"{fmt(row['ttft_p50_ms'])} / p99 {fmt(row['ttft_p99_ms'])} ms, errors {row['errors'] or 0}",
                        flush=True,
                    )
            for server in chosen:  # the round with the median throughput stands for the level
                ranked = sorted(runs[server.label], key=lambda r: r["tokens_per_s"])
                server.rows[users] = ranked[len(ranked) // 2]
    finally:
        for server in chosen:
            stop(server)
    bench_tps = llamacpp_bench_decode()
    ceilings = {"torch": engine_ceiling("baseline"), "llama.cpp": engine_ceiling("llamacpp")}
    text = report(chosen, bench_tps, ceilings, opts)
    print("\n" + text)
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(text + "\n")
    Path(opts.out).with_suffix(".json").write_text(
        json.dumps(
            {
                "servers": {s.label: s.rows for s in chosen},
                "bench_llamacpp_decode_tokens_per_s": bench_tps,
                "engine_alone_decode_tokens_per_s": ceilings,
                "duration_s": opts.duration,
                "max_tokens_mix": MIX,
            },
            indent=2,
        )
        + "\n"
    )
    return 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    raise SystemExit(main())
