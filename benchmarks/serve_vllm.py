"""accelab's server in front of vLLM's engine against `vllm serve` itself: the same model
(SmolLM2-135M fp32), the same vLLM engine settings, the same closed-loop streaming chat load, in
one run on one machine.

- `accelab serve smollm2-135m --plan vllm` with vllm serve's own defaults (compiled, prefix caching
  on; `--mode eager` runs both eager): accelab's routes, tokenizer, stop rules, limits and
  /metrics, vLLM's AsyncLLM in accelab's engine process;
- `vllm serve` from .venv-vllm (src/accelab/backends/vllm_cli.py), the same model directory.

Both start at once and stay up; the rounds interleave (A B B A ...) so a machine shared with other
work slows both alike, and every window records the CPU steal (/proc/stat, the 8th field of the
cpu line) and the load. Users send greedy chat requests one after another, each asking for
max_tokens from a mix of short and long answers (as benchmarks/serve_llm.py). Throughput counts
completion tokens over the window. Prints the table, the medians, the quietest pair and the
verdict (accelab within 5% of vllm serve), and the command; saves both under benchmarks/results/.

    python benchmarks/serve_vllm.py                      # about 10 minutes on 2 CPU cores
    python benchmarks/serve_vllm.py --duration 20 --pairs 2 --mode eager
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from machine import cpu_line, cpu_record

from accelab.catalog import inputs
from accelab.catalog.store import model_dir
from accelab.loadtest.client import LoadConfig, run_load
from accelab.loadtest.summary import SLO, summarize_run

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
MIX = (16, 128, 32, 96, 64, 128, 24, 80)
MODEL = "smollm2-135m"


@dataclass
class Server:
    label: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    url: str = ""
    process: subprocess.Popen | None = None
    log: Path | None = None
    rounds: list[dict[str, Any]] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def servers(mode: str) -> list[Server]:
    a, v = free_port(), free_port()
    options = "vllm_mode=compiled;vllm_prefix_caching=on" if mode == "compiled" else "vllm_mode=eager"
    accelab = Server(
        "accelab serve --plan vllm",
        [
            sys.executable,
            "-m",
            "accelab",
            "serve",
            MODEL,
            "--plan",
            f"vllm[{options}]",
            "--port",
            str(a),
            "--max-tokens",
            "256",
        ],
    )
    vllm_args = ["--enforce-eager", "--no-enable-prefix-caching"] if mode == "eager" else []
    peer = Server(
        "vllm serve",
        [
            str(ROOT / ".venv-vllm" / "bin" / "python"),
            "-P",
            str(ROOT / "src" / "accelab" / "backends" / "vllm_cli.py"),
            "serve",
            str(model_dir(MODEL)),
            "--served-model-name",
            MODEL,
            "--host",
            "127.0.0.1",
            "--port",
            str(v),
            "--dtype",
            "float32",
            *vllm_args,
        ],
    )
    accelab.url, peer.url = f"http://127.0.0.1:{a}", f"http://127.0.0.1:{v}"
    return [accelab, peer]


def start(server: Server, tmp: Path) -> None:
    server.log = tmp / (server.label.split()[0] + ".log")
    server.process = subprocess.Popen(
        server.command,
        stdout=open(server.log, "wb"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )


def wait_ready(server: Server, timeout_s: float = 1200) -> None:
    deadline = time.monotonic() + timeout_s
    path = "/readyz" if server.label.startswith("accelab") else "/health"
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.label} exited:\n{server.log.read_text()[-3000:]}")
        try:
            if httpx.get(server.url + path, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{server.label} not ready after {timeout_s} s")


def stop(server: Server) -> None:
    if server.process is not None and server.process.poll() is None:
        os.killpg(server.process.pid, 15)  # its own session: the server and its engine processes
        try:
            server.process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.process.pid, 9)


def cpu_ticks() -> tuple[int, int]:
    """(steal, total) jiffies of the cpu line of /proc/stat (steal is its 8th field)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    values = [int(x) for x in fields]
    return values[7], sum(values[:8])


def measure(server: Server, users: int, duration: float) -> dict[str, Any]:
    steal0, total0 = cpu_ticks()
    config = LoadConfig(
        url=server.url,
        endpoint="chat",
        inputs=tuple(inputs.prompts(52)),
        model=MODEL,
        concurrency=users,
        duration_s=duration,
        warmup=users,
        max_tokens=MIX,
        stream=True,
        timeout_s=600,
    )
    records = run_load(config, MODEL)
    steal1, total1 = cpu_ticks()
    summary = summarize_run(records, SLO())
    return {
        "users": users,
        "requests": summary["requests"],
        "errors": summary["errors_by_status"],
        "tokens_per_s": summary["output_token_throughput"],
        "ttft_p50_ms": (summary["ttft_ms"] or {}).get("p50"),
        "itl_p50_ms": (summary["itl_ms"] or {}).get("p50"),
        "steal_pct": 100 * (steal1 - steal0) / max(1, total1 - total0),
        "load1": os.getloadavg()[0],
    }


def order(pairs: int) -> list[int]:
    """A B B A A B ...: each server first in half of the pairs."""
    return [i for p in range(pairs) for i in ((0, 1) if p % 2 == 0 else (1, 0))]


def report(all_servers: list[Server], args: argparse.Namespace, started: float) -> str:
    a, v = all_servers
    lines = [
        cpu_line(),
        f"accelab serve --plan vllm vs vllm serve · {MODEL} fp32 · {args.users} users closed loop, streaming chat, "
        f"max_tokens mix {MIX} · {args.pairs} pairs of {args.duration:g} s windows · engines {args.mode}",
        "",
    ]
    lines.append(
        f"{'round':>5}  {'server':<26} {'tokens/s':>9} {'TTFT p50':>9} {'ITL p50':>8} {'req':>5} "
        f"{'errors':>7} {'steal %':>8} {'load':>5}"
    )
    for i in range(args.pairs):
        for s in all_servers:
            r = s.rounds[i]
            lines.append(
                f"{i + 1:>5}  {s.label:<26} {r['tokens_per_s']:>9.1f} {r['ttft_p50_ms'] or 0:>9.0f} "
                f"{r['itl_p50_ms'] or 0:>8.1f} {r['requests']:>5} {sum(r['errors'].values()):>7} "
                f"{r['steal_pct']:>8.1f} {r['load1']:>5.1f}"
            )
    ratios = [ra["tokens_per_s"] / rv["tokens_per_s"] for ra, rv in zip(a.rounds, v.rounds)]
    # quietest: the least load beside the two servers (other people's work shows as load, not steal)
    quiet = min(
        range(args.pairs),
        key=lambda i: a.rounds[i]["load1"] + v.rounds[i]["load1"] + a.rounds[i]["steal_pct"] + v.rounds[i]["steal_pct"],
    )
    med_a = statistics.median(r["tokens_per_s"] for r in a.rounds)
    med_v = statistics.median(r["tokens_per_s"] for r in v.rounds)
    ratio = statistics.median(ratios)
    lines += [
        "",
        f"median tokens/s: accelab {med_a:.1f}, vllm serve {med_v:.1f}; accelab/vllm per pair: "
        + ", ".join(f"{x:.3f}" for x in ratios)
        + f" (median {ratio:.3f})",
        f"quietest pair ({quiet + 1}, steal {a.rounds[quiet]['steal_pct']:.1f}% / {v.rounds[quiet]['steal_pct']:.1f}%, "
        f"load {a.rounds[quiet]['load1']:.1f} / {v.rounds[quiet]['load1']:.1f}): "
        f"accelab/vllm {ratios[quiet]:.3f}",
        f"verdict: accelab is {'within' if ratio >= 0.95 else 'NOT within'} 5% of vllm serve at {args.users} "
        f"users (median ratio {ratio:.3f}, target >= 0.95)",
        f"took {(time.monotonic() - started) / 60:.1f} min; reproduce: python benchmarks/serve_vllm.py "
        + " ".join(shlex.quote(x) for x in sys.argv[1:]),
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--duration", type=float, default=40.0, help="seconds per window")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--mode", choices=("compiled", "eager"), default="compiled")
    parser.add_argument("--out", default="serve_vllm", help="name of the files under benchmarks/results/")
    args = parser.parse_args()
    started = time.monotonic()
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"serve_vllm_{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    all_servers = servers(args.mode)
    try:
        for s in all_servers:
            start(s, tmp)
        for s in all_servers:
            wait_ready(s)
            print(f"ready: {s.label} at {s.url}", flush=True)
        for s in all_servers:  # one untimed window each: compile paths, caches, first requests
            measure(s, args.users, min(10.0, args.duration))
        for n, i in enumerate(order(args.pairs)):
            s = all_servers[i]
            s.rounds.append(measure(s, args.users, args.duration))
            r = s.rounds[-1]
            print(
                f"window {n + 1}: {s.label}: {r['tokens_per_s']:.1f} tokens/s (steal {r['steal_pct']:.1f}%)", flush=True
            )
    finally:
        for s in all_servers:
            stop(s)
    text = report(all_servers, args, started)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.txt").write_text(text + "\n")
    (RESULTS / f"{args.out}.json").write_text(
        json.dumps(
            {
                "cpu": cpu_record(),
                "args": vars(args),
                "servers": [{"label": s.label, "command": s.command, "rounds": s.rounds} for s in all_servers],
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
