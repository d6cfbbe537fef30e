"""How much the torch engine's decode step slows when something else wants the CPU a fraction of
the time: a Python thread in the same process (what the server's event loop does while it
streams), or another process. Each case interleaved with the step alone, medians of 20 steps
(SmolLM2-135M, the server's own step engine, no HTTP), CPU steal of the run printed.

On a 2-core machine every parallel region of torch's two OpenMP threads waits for the slower
one, so a core taken 10% of the time costs more than 10% of the step.

    python benchmarks/step_contention.py                      # bf16, 8 sequences, ~2 min
    python benchmarks/step_contention.py --plan baseline --sequences 16 --threads 1
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import profile_serve_step as P  # a sibling script, not a package

PERIOD_S = 0.002  # busy for duty x PERIOD_S, then asleep for the rest


def busy_thread(duty: float, stop: threading.Event) -> None:
    event = {"choices": [{"delta": {"content": "hello"}, "index": 0}], "id": "x" * 30}
    while not stop.is_set():
        started = time.perf_counter()
        while time.perf_counter() - started < PERIOD_S * duty:
            json.dumps(event)
        time.sleep(PERIOD_S * (1 - duty))


def busy_process(duty: float, until: float) -> None:
    while time.time() < until:
        started = time.perf_counter()
        while time.perf_counter() - started < PERIOD_S * duty:
            pass
        time.sleep(PERIOD_S * (1 - duty))


def steal() -> tuple[int, int]:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return fields[7], sum(fields)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", default="bf16")
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duties", default="0.1,0.3")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine, stepper = P.load(args.plan, (args.sequences,))
    prompt = tuple(engine.prepare_chat([{"role": "user", "content": "Tell me a story about a dragon."}]).ids)
    ids = range(9000, 9000 + args.sequences)
    blocks_of = P.block_tables(stepper, ids, len(prompt) + 2000)
    state = {"tokens": P.prefill(engine, stepper, ids, prompt, blocks_of=blocks_of), "pos": len(prompt)}

    def steps(n: int = 20) -> float:
        times = []
        for _ in range(n):
            started = time.perf_counter()
            state["tokens"] = P.decode(stepper, ids, state["tokens"], state["pos"], blocks_of=blocks_of)
            times.append(time.perf_counter() - started)
            state["pos"] += 1
        return 1000 * statistics.median(times)

    print(f"{args.plan}, {args.sequences} sequences decoding, torch threads {torch.get_num_threads()}")
    before = steal()
    for _ in range(args.rounds):
        line = [f"alone {steps():.1f} ms"]
        for duty in (float(d) for d in args.duties.split(",")):
            stop = threading.Event()
            thread = threading.Thread(target=busy_thread, args=(duty, stop))
            thread.start()
            line.append(f"thread {duty:.0%} busy {steps():.1f} ms")
            stop.set()
            thread.join()
            other = multiprocessing.Process(target=busy_process, args=(duty, time.time() + 120))
            other.start()
            line.append(f"process {duty:.0%} busy {steps():.1f} ms")
            other.terminate()
            other.join()
        print("  " + " | ".join(line))
    after = steal()
    print(f"CPU steal over the run: {100 * (after[0] - before[0]) / max(1, after[1] - before[1]):.2f}%")
    print("reproduce: python benchmarks/step_contention.py " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
