"""Vision-language serving: accelab's continuous batch against its per-batch scheduler and the peers.

    python benchmarks/serve_vlm.py                       # smolvlm-256m, every contender, 2 rounds
    python benchmarks/serve_vlm.py --users 1,8 --rounds 3 --only continuous,static,vllm

Every server is up for the whole run (the idle ones show up as other processes in each window's
noise) and the windows interleave (A B C ... C B A), each with its CPU steal. The load is
closed-loop streaming chat (greedy, max_tokens cycling 16-64), one request per user at a time:
- unique:   a new image in every request (generated:256, 224 px noise: nothing to reuse),
- repeated: accelab's 14 sample photos in turn (an encoder cache and a prefix cache can reuse),
- mixed:    every second request carries a new image, the others are text only,
- text:     text only (the reference for the mixed load's text TTFT).
Contenders: `accelab serve` (continuous batching, fp32 and --plan bf16), `accelab serve
--scheduler static` (one generate call per batch), `transformers serve` at its defaults and with
--continuous-batching, and `vllm serve` (CPU, its defaults: compiled, bf16) on the same model
directory where it loads it (else its error is reported). The model is catalog's smolvlm-256m:
SmolVLM-256M's architecture and sizes, SmolLM2-135M's real weights, a random vision tower.
Results: benchmarks/results/serve_vlm.{txt,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import llm_servers as S
from machine import cpu_line, cpu_record

from accelab.catalog.store import model_dir
from accelab.loadtest.images import load_images

RESULTS = S.ROOT / "benchmarks" / "results"
MIX = (32, 64, 16, 48)  # max_tokens of successive requests
WORKLOADS = {  # name -> (images spec, every Nth request carries one)
    "unique": ("generated:256", 1),  # a fresh pool for every window (seeded by the window): see pool()
    "repeated": ("sample:14", 1),
    "mixed": ("generated:256", 2),
    "text": (None, 1),
}
MAIN = ("continuous", "continuous-bf16", "static", "transformers", "transformers-cb", "vllm")
IMAGE_METRICS = (
    "accelab_images_encoded_total",
    "accelab_image_cache_hits_total",
    "accelab_image_encoder_seconds_total",
)


COMPILED = "bf16[compile=default]"  # bf16 with the language part's decoding steps compiled
INT8 = "int8-bf16[compile=default;quantize_head=true]"  # the language part's weights int8 (its tower stays bf16)


def contenders(opts: argparse.Namespace, before_src: Path | None = None) -> dict[str, S.Server]:
    model, path = opts.model, model_dir(opts.model)
    seqs = max(*opts.users, 8)
    common = ["--max-batch-size", str(seqs), "--max-queue", "256", "--request-timeout", "600", "--max-tokens", "64"]
    common += ["--max-image-pixels", str(1024 * 1024)]
    cb = S.transformers_serve(path)
    plain = S.transformers_serve(path)
    plain.command = [part for part in plain.command if part != "--continuous-batching"]
    plain.label = "transformers serve (its defaults)"
    out = {
        "continuous": S.accelab("accelab serve (continuous, fp32)", model, *common),
        "continuous-bf16": S.accelab("accelab serve --plan bf16 (continuous)", model, *common, "--plan", "bf16"),
        "continuous-bf16-compiled": S.accelab(
            "accelab serve --plan 'bf16[compile=default]' (continuous)", model, *common, "--plan", COMPILED
        ),
        "continuous-bf16-compiled-share2": S.accelab(
            "accelab serve --plan 'bf16[compile=default]' --encoder-share 2",
            model,
            *common,
            "--plan",
            COMPILED,
            "--encoder-share",
            "2",
        ),
        "continuous-int8": S.accelab(f"accelab serve --plan '{INT8}' (continuous)", model, *common, "--plan", INT8),
        "continuous-int8-share2": S.accelab(
            f"accelab serve --plan '{INT8}' --encoder-share 2", model, *common, "--plan", INT8, "--encoder-share", "2"
        ),
        "continuous-bf16-1": S.accelab(
            "accelab serve --plan bf16 --max-step-images 1", model, *common, "--plan", "bf16", "--max-step-images", "1"
        ),
        "continuous-bf16-batch1": S.accelab(
            "accelab serve --plan bf16 --encoder-batch 1", model, *common, "--plan", "bf16", "--encoder-batch", "1"
        ),
        "continuous-bf16-batch4": S.accelab(
            "accelab serve --plan bf16 --encoder-batch 4", model, *common, "--plan", "bf16", "--encoder-batch", "4"
        ),
        "continuous-bf16-share2": S.accelab(
            "accelab serve --plan bf16 --encoder-share 2", model, *common, "--plan", "bf16", "--encoder-share", "2"
        ),
        "static": S.accelab("accelab serve --scheduler static (fp32)", model, *common, "--scheduler", "static"),
        "static-bf16": S.accelab(
            "accelab serve --plan bf16 --scheduler static", model, *common, "--plan", "bf16", "--scheduler", "static"
        ),
        "transformers": plain,
        "transformers-cb": cb,
        "vllm": S.vllm_serve(path, model, max_num_seqs=seqs, dtype="bfloat16", max_model_len=4096),
    }
    if before_src is not None:  # the server as it was at --before, beside this one
        out["before"] = S.accelab(
            f"accelab serve (continuous, fp32) at {opts.before}", model, *common, pythonpath=str(before_src)
        )
        out["before-bf16"] = S.accelab(
            f"accelab serve --plan bf16 at {opts.before}", model, *common, "--plan", "bf16", pythonpath=str(before_src)
        )
        at = f"accelab serve --plan '{INT8}' at {opts.before}"
        out["before-int8"] = S.accelab(at, model, *common, "--plan", INT8, pythonpath=str(before_src))
    wanted = opts.only.split(",") if opts.only else list(MAIN)
    missing = [k for k in wanted if k not in out]
    if missing:
        raise SystemExit(f"--only names {missing}; choose from {sorted(out)}")
    return {k: out[k] for k in wanted}


def image_counts(server: S.Server) -> dict[str, float] | None:
    """An accelab server's image counters from /metrics (None for the peers)."""
    if server.ready_path != "/readyz":
        return None
    values = {}
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in IMAGE_METRICS:
            values[name] = float(value)
    return values


def pool(spec: str | None, seed: int) -> tuple[str, ...]:
    """The images of a window: generated ones are drawn afresh for each (cell, round), so no round
    reuses what an earlier one left in a server's encoder or prefix cache; every server of a round
    gets the same pictures."""
    if not spec:
        return ()
    key = (spec, seed if spec.startswith("generated") else 0)
    if key not in IMAGES:
        IMAGES[key] = load_images(spec, seed=key[1])
    return IMAGES[key]


def window(server: S.Server, users: int, workload: str, duration_s: float, seed: int) -> dict[str, Any]:
    """One closed-loop window of `workload` from `users` users, and the images the server encoded."""
    spec, every = WORKLOADS[workload]
    before = image_counts(server)
    row = S.window(server, users, duration_s, mix=MIX, images=pool(spec, seed), images_every=every)
    after = image_counts(server)
    row["workload"] = workload
    if before is not None and after is not None:
        row.update({k.removeprefix("accelab_"): after.get(k, 0.0) - before.get(k, 0.0) for k in IMAGE_METRICS})
    return row


IMAGES: dict[tuple[str, int], tuple[str, ...]] = {}  # (images spec, seed) -> data URIs, made once
ROWS: dict[str, dict[str, list[dict[str, Any]]]] = {}  # server label -> "workload@users" -> one row per round


def rows_of(server: S.Server, key: str) -> list[dict[str, Any]]:
    return ROWS.get(server.label, {}).get(key, [])


def cells(opts: argparse.Namespace) -> list[tuple[str, int]]:
    """(workload, users) windows: unique images at every level, the others at 8 users."""
    out = [("unique", u) for u in opts.users]
    out += [(w, 8) for w in ("repeated", "mixed", "text") if w in opts.workloads]
    return out


def measure(servers: dict[str, S.Server], opts: argparse.Namespace) -> None:
    for c, (workload, users) in enumerate(cells(opts)):
        for r, order in enumerate(S.rotation(list(servers.values()), opts.rounds)):
            for server in order:
                row = window(server, users, workload, opts.duration, seed=1000 * c + r)
                row["round"] = r
                ROWS.setdefault(server.label, {}).setdefault(f"{workload}@{users}", []).append(row)
                encoded = row.get("images_encoded_total")
                images = (
                    f"  encoded {encoded:.0f} of {row['image_requests']} image requests" if encoded is not None else ""
                )
                print(
                    f"  {workload:<8} {users:>2} users round {r + 1}  {server.label:<42} "
                    f"{row['tokens_per_s']:7.1f} tok/s  TTFT p50 {fmt(row['ttft_p50_ms'])} p99 "
                    f"{fmt(row['ttft_p99_ms'])} ms (text p99 {fmt(row['text_ttft_p99_ms'])})  "
                    f"steal {pct(row['steal'])}  errors {row['errors']}{images}",
                    flush=True,
                )


def fmt(value: Any, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def med(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def report(servers: dict[str, S.Server], failed: dict[str, str], opts: argparse.Namespace) -> str:
    lines = [
        cpu_line(),
        f"serve_vlm: {opts.model}, closed-loop streaming chat (max_tokens {'/'.join(map(str, MIX))}, greedy), "
        f"{opts.duration:.0f} s windows, {opts.rounds} interleaved rounds; medians over rounds (every round below)",
        f"machine: {os.cpu_count()} CPUs; reproduce: python benchmarks/serve_vlm.py {shlex.join(sys.argv[1:])}",
        "",
        f"| workload @ users | {' | '.join(s.label for s in servers.values())} |",
        "|---|" + "---|" * len(servers),
    ]
    for workload, users in cells(opts):
        key = f"{workload}@{users}"
        cells_ = []
        for s in servers.values():
            rows = rows_of(s, key)
            tps, p99 = med(rows, "tokens_per_s"), med(rows, "ttft_p99_ms")
            cells_.append(f"{fmt(tps, 1)} tok/s, TTFT p99 {fmt(p99)} ms")
        lines.append(f"| {key} | {' | '.join(cells_)} |")
    lines += ["", "every window:"]
    for s in servers.values():
        for key, rows in ROWS.get(s.label, {}).items():
            for row in rows:
                lines.append(f"  {s.label} {key} " + json.dumps({k: v for k, v in row.items() if k != "users"}))
    for label, error in failed.items():
        lines += ["", f"{label} did not start; the end of its log:", error]
    lines += ["", *verdicts(servers)]
    return "\n".join(lines)


def verdicts(servers: dict[str, S.Server]) -> list[str]:
    out = []

    def ratio(a: str, b: str, key: str, field: str = "tokens_per_s") -> float | None:
        if a not in servers or b not in servers:
            return None
        x, y = med(rows_of(servers[a], key), field), med(rows_of(servers[b], key), field)
        return x / y if x and y else None

    for best in ("continuous", "continuous-bf16", "continuous-bf16-compiled"):
        static = "static-bf16" if "bf16" in best and "static-bf16" in servers else "static"
        r = ratio(best, static, "unique@8")
        if r is not None:
            out.append(
                f"{servers[best].label} / {servers[static].label} at 8 users, unique images: {r:.2f}x tokens/s "
                "(target >= 2x)"
            )
        t = ratio(best, static, "unique@8", "ttft_p99_ms")
        if t is not None:
            out.append(f"  TTFT p99 {t:.2f}x static's (target <= 1.00x)")
        v = ratio(best, "vllm", "unique@8")
        if v is not None:
            out.append(f"{servers[best].label} / vLLM at 8 users, unique images: {v:.2f}x tokens/s (target >= 1x)")
    if "continuous" in servers:
        mixed = med(rows_of(servers["continuous"], "mixed@8"), "text_ttft_p99_ms")
        text = med(rows_of(servers["continuous"], "text@8"), "text_ttft_p99_ms")
        if mixed and text:
            out.append(
                f"continuous: text TTFT p99 in the mixed load {mixed / text:.2f}x the text-only run (target <= 1.5x)"
            )
        rows = rows_of(servers["continuous"], "repeated@8")
        if rows:
            encoded = sum(r.get("images_encoded_total", 0) for r in rows)
            out.append(
                f"continuous, repeated photos: the encoder ran {encoded:.0f} times for "
                f"{sum(r['image_requests'] for r in rows)} image requests over 14 distinct photos"
            )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smolvlm-256m")
    parser.add_argument("--users", default="1,4,8,16", help="levels of the unique-image load, comma-separated")
    parser.add_argument("--workloads", default="repeated,mixed,text", help="the loads run at 8 users besides unique")
    parser.add_argument("--duration", type=float, default=25.0, help="seconds per window")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", default="", help=f"servers, comma-separated (default: {','.join(MAIN)})")
    parser.add_argument("--out", default=str(RESULTS / "serve_vlm.txt"))
    parser.add_argument(
        "--before", default="", help="a commit whose server runs beside (--only before,before-bf16,before-int8)"
    )
    opts = parser.parse_args()
    opts.users = [int(u) for u in opts.users.split(",")]
    opts.workloads = [w for w in opts.workloads.split(",") if w]
    started = time.monotonic()
    failed: dict[str, str] = {}
    wants_before = opts.before and {"before", "before-bf16"} & set(opts.only.split(","))
    with (
        tempfile.TemporaryDirectory(prefix="serve_vlm-") as tmp,
        S.source_at(opts.before if wants_before else None, Path(tmp) / "before") as before_src,
    ):
        servers = contenders(opts, before_src)
        try:
            for server in servers.values():
                print(f"starting {server.label}: {server.shell()}", flush=True)
                S.start(server, Path(tmp))
            for key, server in list(servers.items()):
                try:
                    S.wait_ready(server)
                    print(f"ready: {server.label}", flush=True)
                except RuntimeError as err:  # a peer that cannot serve this model: reported, the rest go on
                    failed[server.label] = str(err)[-2500:]
                    print(f"{server.label} did not start:\n{failed[server.label]}", flush=True)
                    S.stop(server)
                    del servers[key]
            measure(servers, opts)
        finally:
            for server in servers.values():
                S.stop(server)
    text = report(servers, failed, opts) + f"\ntook {(time.monotonic() - started) / 60:.1f} min"
    print("\n" + text)
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    payload = {
        "cpu": cpu_record(),
        "servers": {s.label: ROWS.get(s.label, {}) for s in servers.values()},
        "commands": {s.label: s.shell() for s in servers.values()},
        "failed": failed,
        "duration_s": opts.duration,
        "rounds": opts.rounds,
        "max_tokens_mix": MIX,
    }
    out.with_suffix(".json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
