"""Dynamic batching against one request per model call: the same model (minilm-l6 embeddings),
the same plan and SLO; the highest request rate each server sustains (`loadtest --find-max`).

Both servers run at once, each its own process (`python -m accelab.serve`) on a free port, and
the two find-max searches take turns probe by probe, so that a machine shared with other work
slows both alike: the ratio is measured in one run. Prints both maximum rates, the ratio, and
the commands that reproduce each half by hand. Each search is stored in the results store
(kind "loadtest", tag "serve-batching").

Then the ceiling: the server's own engine, without HTTP, timed on the same sentences at batch 1
and at the largest batch. Batching cannot gain more than the model's cost per input falls
between the two, so the printout says how much of that ceiling the server kept.

    python benchmarks/serve_batching.py                   # 3-5 minutes on 2 CPU cores
    python benchmarks/serve_batching.py --slo e2e=100ms --duration 4
"""

from __future__ import annotations

import argparse
import shlex
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from accelab.catalog.inputs import sentences
from accelab.loadtest.client import LoadConfig
from accelab.loadtest.findmax import FindMax, find_max, goodput_at_least
from accelab.loadtest.run import build_result, measure_once
from accelab.loadtest.summary import parse_slo
from accelab.results.store import open_store
from accelab.serve.testing import ServerProcess

SERVERS = {  # label -> batching options; everything else is the same
    "one request per call": ["--max-batch-size", "1", "--max-wait-ms", "0"],
    "dynamic batching": ["--max-batch-size", "32", "--max-wait-ms", "5"],
}


class Turns:
    """Two searches in two threads, one probe at a time, alternating while both run."""

    def __init__(self, names: list[str]):
        self.order = list(names)
        self.cond = threading.Condition()

    def run(self, name: str, probe: Callable[[], Any]) -> Any:
        with self.cond:
            self.cond.wait_for(lambda: self.order[0] == name)
        try:
            return probe()
        finally:
            with self.cond:
                self.order.append(self.order.pop(0))
                self.cond.notify_all()

    def leave(self, name: str) -> None:
        with self.cond:
            self.order.remove(name)
            self.cond.notify_all()


def server_args(opts: argparse.Namespace, batching: list[str]) -> list[str]:
    args = ["accelab.serve", opts.model, "--port", "0", *batching, "--max-queue", "128",
            "--request-timeout", str(opts.request_timeout)]
    for item in opts.set:
        args += ["--set", item]
    return args


def loadtest_cli(opts: argparse.Namespace, url: str) -> list[str]:
    return ["accelab", "loadtest", url, "--endpoint", "embeddings", "--find-max", "--rate", str(opts.start_rate),
            "--slo", opts.slo, "--goodput-target", str(opts.goodput_target), "--duration", str(opts.duration),
            "--max-steps", str(opts.max_steps), "--warmup", "8", "--timeout", "10", "--cooldown", str(opts.cooldown),
            "--max-in-flight", "256"]


def search(label: str, url: str, opts: argparse.Namespace, turns: Turns, out: dict[str, Any]) -> None:
    slo = parse_slo(opts.slo)
    config = LoadConfig(url=url, endpoint="embeddings", inputs=tuple(sentences(224)), model=opts.model,
                        rate=opts.start_rate, duration_s=opts.duration, warmup=8, timeout_s=10, seed=0,
                        max_in_flight=256)

    def show(rate: float, s: dict[str, Any]) -> None:
        p99 = (s.get("e2e_ms") or {}).get("p99", float("nan"))
        print(f"  [{label}] {rate:7.1f} req/s offered: {s['request_throughput']:7.1f} served, goodput "
              f"{s['goodput_fraction']:6.1%}, e2e p99 {p99:8.1f} ms, errors {s['errors_by_status'] or 0}", flush=True)

    def probe(rate: float) -> dict[str, Any]:
        time.sleep(opts.cooldown)  # both servers shed any backlog of the last probe first
        return measure_once(config, opts.model, slo, rate)

    def measure(rate: float) -> dict[str, Any]:
        summary = turns.run(label, lambda: probe(rate))
        show(rate, summary)
        return summary

    try:
        found = find_max(measure, goodput_at_least(opts.goodput_target), start_rate=opts.start_rate,
                         max_steps=opts.max_steps)
        result = build_result(config, opts.model, slo, search=found, goodput_target=opts.goodput_target,
                              tag="serve-batching")
        result.notes.append(f"benchmarks/serve_batching.py: {label}")
        open_store(opts.db).add(result)
        out[label] = found
    finally:
        turns.leave(label)


def model_ceiling(opts: argparse.Namespace, max_batch: int, seconds: float = 3.0, rounds: int = 3) -> dict[int, float]:
    """Seconds per input of the server's engine alone (the same plan, sentences and code path),
    at batch 1 and at max_batch, best of interleaved rounds."""
    import torch

    from accelab.catalog.resolve import resolve
    from accelab.plan.apply import apply_plan
    from accelab.plan.plan import load_plan
    from accelab.serve.engines import build_engine

    engine = build_engine(apply_plan(resolve(opts.model), load_plan("baseline", opts.set), torch.device("cpu")),
                          name=opts.model)
    try:
        units = [engine.prepare_text(text) for text in sentences(224)]
        best = {1: float("inf"), max_batch: float("inf")}
        for _ in range(rounds):
            for size in best:
                engine.embed(units[:size])  # warm
                done, start = 0, time.perf_counter()
                while time.perf_counter() - start < seconds:
                    first = done % (len(units) - size)
                    engine.embed(units[first:first + size])
                    done += size
                best[size] = min(best[size], (time.perf_counter() - start) / done)
        return best
    finally:
        engine.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="minilm-l6")
    parser.add_argument("--slo", default="e2e=500ms",
                        help="per-request SLO both servers must meet; loose enough that capacity decides, not "
                             "one request's latency on a busy shared CPU")
    parser.add_argument("--goodput-target", type=float, default=0.99,
                        help="share of requests that must meet the SLO: 0.99 makes it a p99 SLO")
    parser.add_argument("--start-rate", type=float, default=16.0)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds of load per find-max probe")
    parser.add_argument("--max-steps", type=int, default=8, help="probes per search")
    parser.add_argument("--cooldown", type=float, default=2.0, help="seconds of quiet before each probe")
    parser.add_argument("--request-timeout", type=float, default=2.0,
                        help="server --request-timeout: an overloaded probe drains in this time, not minutes")
    parser.add_argument("--set", action="append", default=["threads=1"],
                        help="plan override for both servers (default threads=1: the load tester needs a core)")
    parser.add_argument("--db", default=None, help="results store (default: the cache dir's)")
    opts = parser.parse_args()

    servers: dict[str, ServerProcess] = {}
    found: dict[str, FindMax] = {}
    try:
        for label, batching in SERVERS.items():
            args = server_args(opts, batching)
            print(f"starting {label}: python -m {shlex.join(args)}", flush=True)
            servers[label] = ServerProcess(*args, timeout_s=300)
        for server in servers.values():
            server.wait_ready(timeout_s=300)
        print(f"\nfind-max, SLO {opts.slo} for >= {opts.goodput_target:.0%} of requests, probes alternate:")
        turns = Turns(list(SERVERS))
        threads = [threading.Thread(target=search, args=(label, servers[label].url, opts, turns, found))
                   for label in SERVERS]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for server in servers.values():
            server.stop()

    print(f"\n{opts.model} embeddings, SLO {opts.slo} for >= {opts.goodput_target:.0%} of requests, "
          f"plan overrides {opts.set}")
    for label in SERVERS:
        best = found[label].best_rate if label in found else None
        note = "" if label in found and found[label].saturated else " (search did not saturate)"
        print(f"  {label:<22} max sustainable rate: {'none' if best is None else f'{best:.1f} req/s'}{note}")
    base, batched = (found[label].best_rate if label in found else None for label in SERVERS)
    if base and batched:
        print(f"  dynamic batching sustains {batched / base:.2f}x the rate of one request per call")
    max_batch = int(SERVERS["dynamic batching"][1])
    cost = model_ceiling(opts, max_batch)
    ceiling = cost[1] / cost[max_batch]
    print(f"\nthe model alone (the server's engine, no HTTP, same sentences and plan): {cost[1] * 1000:.2f} ms per input "
          f"at batch 1, {cost[max_batch] * 1000:.2f} ms at batch {max_batch}: batching can gain at most {ceiling:.2f}x here")
    if base and batched:
        print(f"  the server kept {batched / base / ceiling:.0%} of that ceiling; one request per call ran at "
              f"{base * cost[1]:.0%} of the model's batch-1 pace, dynamic batching at {batched * cost[max_batch]:.0%} "
              f"of its batch-{max_batch} pace")
    print("\nreproduce one half by hand (then Ctrl+C the server):")
    for label, batching in SERVERS.items():
        serve = ["accelab", "serve", *server_args(opts, batching)[1:]]
        serve[serve.index("--port") + 1] = "8000"
        print(f"  {shlex.join(serve)} &\n  {shlex.join(loadtest_cli(opts, 'http://127.0.0.1:8000'))}")
    print(f"reproduce all of it: python {shlex.join(sys.argv)}")
    return 0 if base and batched else 1


if __name__ == "__main__":
    raise SystemExit(main())
