"""A soak: one `accelab serve` under a mixed load for a long time, and whether anything grows.

The load, from `--users` concurrent clients, each request drawn at random (seeded) from:
- streamed chat, plain chat and completions (sampled and greedy, short and long answers);
- bad requests: a body that is not JSON, an unknown field, a negative max_tokens, another model,
  a prompt past the context (each must get its 4xx, never a 5xx);
- clients that leave mid-stream (read a few events, then close the connection);
- embeddings, against a second server (`--embeddings-model`, default minilm-l6; '' for none).

Every `--sample-s` seconds: the generation server's resident memory, open file descriptors and
threads (from /proc), and its KV-cache blocks in use (/metrics); at the end, after the load has
stopped, the same once more. A request is lost when a good request does not get its 200 (an error
status, a broken connection, a timeout) or a bad one gets a 5xx. The report says whether the
figures stayed flat and how many requests were lost. Resident memory is judged by its slope:
least squares over the samples after the warm-up (`--warmup-min`), in MB per hour with a 95%
interval; the soak passes when the interval's upper end is under `--max-slope` (5 MB/h). The
interval widens for samples that are not independent (memory one minute on is close to memory
now): the slope's standard error is Newey-West's, with as many lags as the cube root of the
samples' count rounds to (soak_slope.py). File descriptors and threads are judged by their last
sample against the first after the warm-up (a count, not a trend).

The server runs at its defaults (`accelab serve MODEL --plan PLAN`, nothing else).

    python benchmarks/soak.py --minutes 120         # the two-hour soak
    python benchmarks/soak.py --minutes 10 --users 6
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import llm_servers as S
from machine import cpu_line
from soak_slope import slope_mb_per_hour

RESULTS = Path(__file__).parent / "results"
KINDS = {  # kind -> weight
    "chat-stream": 25,
    "chat": 15,
    "completion": 15,
    "chat-sampled": 10,
    "disconnect": 10,
    "bad-json": 4,
    "bad-field": 4,
    "bad-max-tokens": 4,
    "bad-model": 4,
    "too-long": 4,
    "embeddings": 5,
}
QUESTIONS = ["What is the capital of France?", "Write a haiku about rain.", "List three fruits.", "Explain DNS."]


def proc_figures(pid: int) -> dict[str, float]:
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {
        "rss_mb": int(fields["VmRSS"].split()[0]) / 1024,
        "threads": int(fields["Threads"]),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
    }


def kv_used(url: str) -> float | None:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith('accelab_kv_cache_blocks{state="used"}'):
            return float(line.rsplit(" ", 1)[1])
    return None


async def one(client: httpx.AsyncClient, kind: str, gen: S.Server, emb: S.Server | None, rng: random.Random) -> str:
    """Send one request of `kind`; 'ok' when the answer is the expected one, else what went wrong."""
    chat = {"model": gen.model, "messages": [{"role": "user", "content": rng.choice(QUESTIONS)}]}
    short = {"max_tokens": rng.choice((8, 16, 32, 64)), "temperature": 0}
    if kind == "embeddings":
        if emb is None:
            return "skipped"
        r = await client.post(f"{emb.url}/v1/embeddings", json={"model": emb.model, "input": rng.choice(QUESTIONS)})
        return "ok" if r.status_code == 200 else f"status {r.status_code}"
    if kind in ("chat-stream", "disconnect"):
        body = {**chat, **short, "stream": True}
        async with client.stream("POST", f"{gen.url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return f"status {r.status_code}"
            events = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events += 1
                    if kind == "disconnect" and events == 3:
                        return "ok"  # leaving: the context manager closes the connection
                    if line == "data: [DONE]":
                        return "ok"
                    if '"error"' in line:
                        return "error event"
            return "ok" if kind == "disconnect" else "stream ended without [DONE]"
    if kind == "chat":
        r = await client.post(f"{gen.url}/v1/chat/completions", json={**chat, **short})
    elif kind == "chat-sampled":
        r = await client.post(
            f"{gen.url}/v1/chat/completions",
            json={**chat, "max_tokens": 32, "temperature": 0.8, "top_p": 0.95, "seed": rng.randrange(1000)},
        )
    elif kind == "completion":
        r = await client.post(f"{gen.url}/v1/completions", json={"model": gen.model, "prompt": "Once upon", **short})
    else:  # the bad ones: each must be refused with a 4xx
        if kind == "bad-json":
            r = await client.post(
                f"{gen.url}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
            )
        elif kind == "bad-field":
            r = await client.post(f"{gen.url}/v1/chat/completions", json={**chat, "best_of": 3})
        elif kind == "bad-max-tokens":
            r = await client.post(f"{gen.url}/v1/chat/completions", json={**chat, "max_tokens": -1})
        elif kind == "bad-model":
            r = await client.post(f"{gen.url}/v1/chat/completions", json={**chat, "model": "no-such-model"})
        else:  # too-long
            r = await client.post(
                f"{gen.url}/v1/completions", json={"model": gen.model, "prompt": "word " * 20000, "max_tokens": 8}
            )
        return "ok" if 400 <= r.status_code < 500 else f"status {r.status_code} for a bad request"
    return "ok" if r.status_code == 200 else f"status {r.status_code}"


async def user(deadline: float, gen: S.Server, emb: S.Server | None, seed: int, tally: dict[str, Any]) -> None:
    rng = random.Random(seed)
    kinds, weights = zip(*KINDS.items())
    async with httpx.AsyncClient(timeout=600) as client:
        while time.monotonic() < deadline:
            kind = rng.choices(kinds, weights)[0]
            try:
                outcome = await one(client, kind, gen, emb, rng)
            except httpx.HTTPError as err:
                outcome = f"{type(err).__name__}"
            tally["requests"][kind] += 1
            if outcome not in ("ok", "skipped"):
                tally["lost"][f"{kind}: {outcome}"] += 1


async def sampler(
    deadline: float, gen: S.Server, every_s: float, samples: list[dict[str, Any]], started: float
) -> None:
    assert gen.process is not None
    while True:
        samples.append(
            {"minute": (time.monotonic() - started) / 60, **proc_figures(gen.process.pid), "kv_used": kv_used(gen.url)}
        )
        print(
            "  " + json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in samples[-1].items()}),
            flush=True,
        )
        if time.monotonic() + every_s > deadline:
            return
        await asyncio.sleep(every_s)


def flat(samples: list[dict[str, Any]], key: str) -> tuple[float, float, bool]:
    """(count after the warm-up, at the end, whether the end is within 2 of it: a worker thread or
    a connection may be open at either moment)."""
    start = samples[min(1, len(samples) - 1)][key]
    end = samples[-1][key]
    return start, end, end <= start + 2


async def main_async(opts: argparse.Namespace, gen: S.Server, emb: S.Server | None) -> dict[str, Any]:
    tally: dict[str, Any] = {"requests": collections.Counter(), "lost": collections.Counter()}
    samples: list[dict[str, Any]] = []
    started = time.monotonic()
    deadline = started + opts.minutes * 60
    await asyncio.gather(
        sampler(deadline, gen, opts.sample_s, samples, started),
        *(user(deadline, gen, emb, opts.seed + i, tally) for i in range(opts.users)),
    )
    await asyncio.sleep(5)  # the last streams' sequences leave the batch
    assert gen.process is not None
    samples.append(
        {"minute": (time.monotonic() - started) / 60, **proc_figures(gen.process.pid), "kv_used": kv_used(gen.url)}
    )
    return {"tally": tally, "samples": samples}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--plan", default="baseline")
    parser.add_argument("--embeddings-model", default="minilm-l6")
    parser.add_argument("--minutes", type=float, default=60)
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--sample-s", type=float, default=60)
    parser.add_argument("--warmup-min", type=float, default=10, help="samples before this minute are not fitted")
    parser.add_argument("--max-slope", type=float, default=5.0, help="MB/h the RSS slope's 95%% upper end stays under")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS / "soak.txt"))
    opts = parser.parse_args()
    gen = S.accelab(f"accelab serve {opts.model} --plan {opts.plan}", opts.model, "--plan", opts.plan)
    emb = S.accelab(f"accelab serve {opts.embeddings_model}", opts.embeddings_model) if opts.embeddings_model else None
    servers = [s for s in (gen, emb) if s is not None]
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        try:
            for server in servers:
                S.start(server, Path(tmp))
            for server in servers:
                S.wait_ready(server)
            print(f"soak: {opts.minutes:g} min, {opts.users} users against {gen.url}", flush=True)
            result = asyncio.run(main_async(opts, gen, emb))
        finally:
            for server in servers:
                S.stop(server)
    samples, tally = result["samples"], result["tally"]
    lines = [
        cpu_line(),
        f"soak of `accelab serve {opts.model} --plan {opts.plan}`: {opts.minutes:g} min, "
        f"{opts.users} closed-loop users, mixed load {dict(KINDS)}; {os.cpu_count()} CPU cores",
        "",
        "| minute | RSS MB | open fds | threads | KV blocks used |",
        "|---|---|---|---|---|",
        *(f"| {s['minute']:.1f} | {s['rss_mb']:.0f} | {s['fds']} | {s['threads']} | {s['kv_used']} |" for s in samples),
        "",
    ]
    verdicts = []
    fitted = [s for s in samples if s["minute"] >= opts.warmup_min]
    if len(fitted) >= 3:
        fit = slope_mb_per_hour([s["minute"] for s in fitted], [s["rss_mb"] for s in fitted])
        ok = fit.high < opts.max_slope
        lines.append(
            f"RSS slope after minute {opts.warmup_min:g} ({len(fitted)} samples): {fit.slope:+.2f} MB/h, 95% interval "
            f"[{fit.low:+.2f}, {fit.high:+.2f}] (Newey-West, {fit.lags} lags): "
            f"{'flat' if ok else f'MAY GROW (upper end over {opts.max_slope:g} MB/h)'}"
        )
    else:
        ok = False
        lines.append(f"RSS slope: {len(fitted)} samples after the warm-up, 3 needed: run longer or sample more often")
    verdicts.append(ok)
    for key in ("fds", "threads"):
        start, end, ok = flat(samples, key)
        verdicts.append(ok)
        lines.append(f"{key}: {start:.0f} after the warm-up, {end:.0f} at the end: {'flat' if ok else 'GREW'}")
    idle_kv = samples[-1]["kv_used"]
    verdicts.append(idle_kv == 0)
    lines.append(f"KV blocks in use once the load stopped: {idle_kv} ({'none held' if idle_kv == 0 else 'LEAKED'})")
    total = sum(tally["requests"].values())
    lost = sum(tally["lost"].values())
    verdicts.append(lost == 0)
    lines.append(f"requests: {total} ({', '.join(f'{k} {v}' for k, v in sorted(tally['requests'].items()))})")
    lines.append(f"lost: {lost}" + (f" ({dict(tally['lost'])})" if lost else ""))
    lines.append(f"verdict: {'OK' if all(verdicts) else 'FAILED'}")
    lines.append(f"reproduce: python {shlex.join(sys.argv)}")
    text = "\n".join(lines)
    print("\n" + text)
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
