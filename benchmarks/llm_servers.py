"""The LLM servers the serving benchmarks run side by side, and one measured window of load.

Each server is a command line started in a session of its own (so stopping it stops its engine
processes too), a URL that answers when it is ready, and the model id requests name. A window
sends closed-loop streaming chat to one server (greedy, max_tokens cycling through a mix of
short and long answers, as chat traffic does) and records, around it, what the machine did
besides (`accelab.measure.noise`: CPU steal, the CPU other processes took, the load): the idle
servers and anything else on the machine show up as other processes.

    interleaved(servers, rounds=4): A B C ... C B A ...: a busy minute hits every server alike
"""

from __future__ import annotations

import contextlib
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from accelab.catalog import inputs
from accelab.loadtest.client import LoadConfig, run_load
from accelab.loadtest.summary import SLO, summarize_run
from accelab.measure.noise import Meter
from accelab.tuner.serve_candidates import stop_session

ROOT = Path(__file__).resolve().parents[1]
MIX = (16, 128, 32, 96, 64, 128, 24, 80)  # max_tokens of successive requests: short and long answers
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
VLLM_CLI = ROOT / "src" / "accelab" / "backends" / "vllm_cli.py"
LLAMA_SERVER = ROOT / "benchmarks" / "peers" / "build" / "bin" / "llama-server"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    label: str
    command: list[str]
    model: str  # the id requests name
    port: int
    ready_path: str = "/health"
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen | None = None
    log: Path | None = None
    windows: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # users -> one row per round

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def shell(self) -> str:
        """The command as a person would type it (the environment it needs first)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (env + " " if env else "") + shlex.join(self.command)


# -- the servers ---------------------------------------------------------------------------------
@contextlib.contextmanager
def source_at(rev: str | None, into: Path) -> Iterator[Path | None]:
    """The `src` of commit `rev` (a detached worktree at `into`, removed after), for a server as it
    was then beside the one of the working tree; None when no `rev` is asked for."""
    if not rev:
        yield None
        return
    git = ["git", "-C", str(ROOT), "worktree"]
    subprocess.run([*git, "add", "--detach", "-f", str(into), rev], check=True, capture_output=True)
    try:
        yield into / "src"
    finally:
        subprocess.run([*git, "remove", "--force", str(into)], check=False, capture_output=True)


def accelab(label: str, model: str, *args: str, pythonpath: str | None = None) -> Server:
    port = free_port()
    command = [sys.executable, "-m", "accelab", "serve", model, "--port", str(port), *args]
    return Server(label, command, model, port, "/readyz", env={"PYTHONPATH": pythonpath} if pythonpath else {})


def vllm_serve(
    model_path: Path,
    name: str,
    *,
    max_num_seqs: int,
    dtype: str = "bfloat16",
    eager: bool = False,
    max_model_len: int | None = None,
    label: str = "",
) -> Server:
    """`vllm serve` from accelab's vLLM venv at its defaults (compiled: torch.compile of the model
    with its CPU attention backend) in `dtype`; vllm_cli.py sets the environment vLLM CPU's docs
    ask for (tcmalloc and Intel OpenMP preloaded, OpenMP threads bound to this machine's cores, a
    2 GiB KV cache). `eager` (--enforce-eager) switches its compilation off: a handicapped peer,
    labelled so, for reference only. `label` names a quantized checkpoint (W8A8)."""
    port = free_port()
    command = [
        str(VLLM_PYTHON), "-P", str(VLLM_CLI), "serve", str(model_path), "--served-model-name", name,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-num-seqs", str(max_num_seqs),
    ]  # fmt: skip
    if max_model_len:  # a model whose configured context's KV cache would not fit vLLM CPU's 2 GiB
        command += ["--max-model-len", str(max_model_len)]
    short = {"bfloat16": "bf16", "float32": "fp32"}.get(dtype, dtype)
    kind = f"{label} checkpoint, {short} activations outside int8" if label else short
    label = f"vllm serve (CPU, {kind}, its defaults: compiled)"
    if eager:
        command.append("--enforce-eager")
        label = f"vllm serve (CPU, {short}) --enforce-eager [handicapped: compilation off]"
    return Server(label, command, name, port)


def llama_server(gguf: Path, name: str, *, slots: int, threads: int, context: int = 16384) -> Server:
    """llama.cpp's own server (benchmarks/peers/build_llama_server.sh) on the same GGUF, at the
    configuration its docs give for serving many users: one slot per user over a unified KV
    cache (`--kv-unified`: the slots share the context, so a long answer is not capped at
    context / slots), continuous batching (its default), the machine's threads for both phases."""
    port = free_port()
    command = [
        str(LLAMA_SERVER), "-m", str(gguf), "--alias", name, "--host", "127.0.0.1", "--port", str(port),
        "-np", str(slots), "--kv-unified", "-c", str(context), "-t", str(threads), "-tb", str(threads), "--no-webui",
    ]  # fmt: skip
    return Server(
        f"llama-server -np {slots} --kv-unified -t {threads} ({gguf.parent.name}/{gguf.name})", command, name, port
    )


def transformers_serve(model_path: Path) -> Server:
    port = free_port()
    cli = Path(sys.executable).parent / "transformers"
    command = [
        str(cli) if cli.exists() else "transformers", "serve", str(model_path), "--continuous-batching",
        "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    return Server("transformers serve --continuous-batching", command, str(model_path), port)


# -- up and down ---------------------------------------------------------------------------------
def start(server: Server, logs: Path) -> None:
    server.log = logs / (server.label.replace(" ", "_").replace("/", "_") + ".log")
    server.process = subprocess.Popen(
        server.command,
        stdout=open(server.log, "wb"),  # the child holds it open
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **server.env},
        start_new_session=True,  # its own process group: stop() ends its engine processes too
    )


def wait_ready(server: Server, timeout_s: float = 1200) -> None:
    assert server.process is not None and server.log is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.label} exited:\n{server.log.read_text(errors='replace')[-3000:]}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(server.url + server.ready_path, timeout=5).status_code == 200:
                return
        time.sleep(1)
    raise RuntimeError(f"{server.label} not ready after {timeout_s:.0f} s (log: {server.log})")


def stop(server: Server) -> None:
    if server.process is not None:
        stop_session(server.process)


# -- one window ----------------------------------------------------------------------------------
def window(
    server: Server,
    users: int,
    duration_s: float,
    *,
    mix: Sequence[int] = MIX,
    images: tuple[str, ...] = (),
    images_every: int = 1,
) -> dict[str, Any]:
    """Closed-loop streaming chat from `users` users for `duration_s` (after a warm-up request
    each), with the machine's noise around it; `images` (data URIs) go with every
    `images_every`-th request, and the row splits out the text-only requests' TTFT p99."""
    assert server.process is not None
    config = LoadConfig(
        url=server.url,
        endpoint="chat",
        inputs=tuple(inputs.prompts(52)),
        model=server.model,
        concurrency=users,
        duration_s=duration_s,
        warmup=users,
        max_tokens=tuple(mix),
        stream=True,
        timeout_s=600,
        images=images,
        images_every=images_every,
    )
    with Meter([server.process.pid, os.getpid()]) as meter:
        records = run_load(config, server.model)
    summary = summarize_run(records, SLO())
    noise = meter.window
    return {
        "users": users,
        "requests": summary["requests"],
        "errors": sum((summary["errors_by_status"] or {}).values()),
        "empty_answers": sum(1 for r in records if r.ok and r.output_tokens == 0),
        "tokens_per_s": summary["output_token_throughput"],
        "ttft_p50_ms": (summary["ttft_ms"] or {}).get("p50"),
        "ttft_p99_ms": (summary["ttft_ms"] or {}).get("p99"),
        "itl_p50_ms": (summary["itl_ms"] or {}).get("p50"),
        "e2e_p50_ms": (summary["e2e_ms"] or {}).get("p50"),
        "image_requests": sum(1 for r in records if r.ok and r.images),
        "first_error": next((r.error or r.status for r in records if not r.ok), None),
        "text_ttft_p99_ms": p99([r.ttft * 1000 for r in records if r.ok and not r.images and r.ttft is not None]),
        "steal": noise.steal if noise else None,
        "others_cores": noise.others_cores if noise else None,
        "load1": noise.load1 if noise else None,
        "level": noise.level if noise else None,
    }


def p99(values: Sequence[float]) -> float | None:
    if len(values) < 2:
        return values[0] if values else None
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def rotation(servers: Sequence[Server], rounds: int) -> list[list[Server]]:
    """The order of each round: A B C, then C B A, then A B C ...: every server as often first as last."""
    return [list(servers) if r % 2 == 0 else list(reversed(servers)) for r in range(rounds)]


def loudness(row: dict[str, Any]) -> float:
    """How much the machine did besides a window: steal plus others' cores (a quarter weight each)."""
    return (row.get("steal") or 0.0) + (row.get("others_cores") or 0.0) / 4


def median_row(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median tokens/s (the lower middle of an even count)."""
    ranked = sorted(rows, key=lambda r: r["tokens_per_s"] or 0.0)
    return ranked[(len(ranked) - 1) // 2]


def median(values: Sequence[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None
