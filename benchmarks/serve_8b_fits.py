"""The 8B on this machine: built, refused where it cannot fit, served where it can (issue 55).

1. `accelab models fetch llama-8b`: the peak RSS of the build (the catalog writes bf16 shards a
   layer pair at a time).
2. `accelab serve llama-8b --plan baseline`: float32 cannot fit 24 GiB; the server must exit 2
   before listening, with the figures.
3. `accelab serve llama-8b --plan int8-weight` (eager): ready, with the peak RSS of its process tree
   (sampled every 0.2 s) against its int8 weights (counted by accelab.plan.fit) plus the KV cache it
   states in /readyz; then a few chats, their tokens/s.

    python benchmarks/serve_8b_fits.py [--plan int8-weight] [--out benchmarks/results/serve_8b_fits.txt]

Needs ~15 GB of disk for the shards and the machine otherwise idle (it takes both cores for minutes).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import cpu_line
from serving import ServerProcess

MODEL = "llama-8b"


class PeakRss:
    """The largest RSS of a process and its children, sampled every `every_s`."""

    def __init__(self, pid: int, every_s: float = 0.2):
        self.pid, self.every_s, self.peak = pid, every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                root = psutil.Process(self.pid)
                total = sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
                self.peak = max(self.peak, total)
            except psutil.Error:
                pass
            self._stop.wait(self.every_s)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", default="int8-weight")
    parser.add_argument("--chats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/serve_8b_fits.txt"))
    args = parser.parse_args()
    lines = [cpu_line(), f"command: python benchmarks/serve_8b_fits.py --plan {args.plan}", ""]

    def say(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    started = time.monotonic()
    build = subprocess.Popen([sys.executable, "-m", "accelab", "models", "fetch", MODEL])
    watch = PeakRss(build.pid)
    build.wait()
    say(f"1. models fetch {MODEL}: exit {build.returncode}, {time.monotonic() - started:.0f} s, peak RSS "
        f"{watch.stop() / 1e9:.2f} GB")  # fmt: skip

    from accelab.catalog.resolve import resolve
    from accelab.plan import fit
    from accelab.plan.plan import load_plan

    spec = resolve(MODEL)
    refused = subprocess.run(
        [sys.executable, "-m", "accelab", "serve", MODEL, "--plan", "baseline", "--port", "0"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    reason = next((line for line in refused.stderr.splitlines() if "does not fit" in line), refused.stderr[-500:])
    say(f"2. serve --plan baseline: exit {refused.returncode}; {reason.strip()}")

    weights = fit.weight_bytes(spec, load_plan(args.plan)) or 0
    started = time.monotonic()
    server = ServerProcess("-m", "accelab", "serve", MODEL, "--plan", args.plan, "--port", "0", timeout_s=600)
    watch = PeakRss(server.proc.pid)
    try:
        server.wait_ready(3600)
        ready_s = time.monotonic() - started
        kv = httpx.get(f"{server.url}/readyz").json().get("kv_cache", {})
        peak_ready = watch.peak
        say(f"3. serve --plan {args.plan}: ready in {ready_s:.0f} s; int8 weights {weights / 1e9:.2f} GB (counted), "
            f"KV cache {kv.get('tokens')} tokens ({(kv.get('bytes') or 0) / 1e9:.2f} GB, stated), peak RSS of the "
            f"process tree {peak_ready / 1e9:.2f} GB = {peak_ready / (weights + (kv.get('bytes') or 0)):.2f}x "
            "weights + KV cache")  # fmt: skip
        for i in range(args.chats):
            t = time.monotonic()
            answer = httpx.post(
                f"{server.url}/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": f"Count to {i + 3}."}],
                      "max_tokens": 16, "temperature": 0, "ignore_eos": True},
                timeout=1800,
            )  # fmt: skip
            took = time.monotonic() - t
            tokens = answer.json()["usage"]["completion_tokens"] if answer.status_code == 200 else 0
            say(f"   chat {i + 1}: HTTP {answer.status_code}, {tokens} tokens in {took:.1f} s "
                f"({tokens / took:.2f} tokens/s, one user)")  # fmt: skip
        say(f"   peak RSS of the process tree after the chats: {watch.peak / 1e9:.2f} GB")
    finally:
        watch.stop()
        server.stop()
        log = "".join(server.log)
        for line in log.splitlines():
            if "KV cache of" in line or "loaded" in line or "continuous batching" in line:
                say(f"   log: {line.strip()[:300]}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
