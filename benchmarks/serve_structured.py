"""What a JSON schema costs: generated tokens/s of one accelab server (real SmolLM2, continuous
batching) at 8 concurrent chat users, with and without `response_format` json_schema
(grammar-constrained decoding, llguidance masks per sequence). Both contenders hit the same
server, in interleaved rounds (free, schema, schema, free, ...), each round's CPU steal recorded
from /proc/stat (8th field of the cpu line); medians and the quietest round are reported.

    .venv/bin/python benchmarks/serve_structured.py --rounds 6 --requests 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
from machine import cpu_line, cpu_record

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from serving import ServerProcess

MODEL = "smollm2-135m"
USERS = 8
SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "country", "population", "facts"],
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
        "population": {"type": "integer"},
        "facts": {"type": "array", "items": {"type": "string", "maxLength": 80}, "maxItems": 3},
    },
}
QUESTIONS = [
    "Describe Paris.",
    "Tell me about Tokyo.",
    "What is Lagos like?",
    "Describe Lima.",
    "Tell me about Oslo.",
    "What is Cairo like?",
    "Describe Toronto.",
    "Tell me about Mumbai.",
]


def steal_ticks() -> tuple[int, int]:
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    ticks = [int(x) for x in fields]
    return ticks[7], sum(ticks[:8])  # steal, total (user .. steal)


async def one_round(url: str, contender: str, requests: int, max_tokens: int) -> dict:
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0.7}
    if contender == "schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}

    async def user(client: httpx.AsyncClient, u: int) -> int:
        tokens = 0
        for r in range(requests):
            reply = await client.post(
                f"{url}/v1/chat/completions",
                json={**body, "seed": 100 * u + r, "messages": [{"role": "user", "content": QUESTIONS[(u + r) % 8]}]},
            )
            reply.raise_for_status()
            tokens += reply.json()["usage"]["completion_tokens"]
        return tokens

    steal0, total0 = steal_ticks()
    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        tokens = sum(await asyncio.gather(*(user(client, u) for u in range(USERS))))
    seconds = time.perf_counter() - started
    steal1, total1 = steal_ticks()
    steal = (steal1 - steal0) / max(1, total1 - total0)
    return {"contender": contender, "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "steal": steal}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="rounds per contender (even: ABBA order)")
    parser.add_argument("--requests", type=int, default=3, help="requests per user per round")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "serve_structured")
    args = parser.parse_args()
    server = ServerProcess(
        "-m",
        "accelab.serve",
        MODEL,
        "--port",
        "0",
        "--max-tokens",
        "256",
        "--max-batch-size",
        str(USERS),
        timeout_s=180,
    )
    rows = []
    try:
        server.wait_ready(timeout_s=300)
        asyncio.run(one_round(server.url, "schema", 1, 16))  # warm-up: the grammar tokenizer, first steps
        order = [("free", "schema") if i % 2 == 0 else ("schema", "free") for i in range(args.rounds)]
        for i, pair in enumerate(order):
            for contender in pair:
                row = asyncio.run(one_round(server.url, contender, args.requests, args.max_tokens))
                row["round"] = i
                rows.append(row)
                print(
                    f"round {i} {contender:6s} {row['tok_s']:6.1f} tok/s ({row['tokens']} tokens in "
                    f"{row['seconds']:.1f} s), steal {row['steal']:.1%}",
                    flush=True,
                )
    finally:
        server.stop()
    summary = {}
    for contender in ("free", "schema"):
        mine = [r for r in rows if r["contender"] == contender]
        quietest = min(mine, key=lambda r: r["steal"])
        summary[contender] = {
            "median_tok_s": statistics.median(r["tok_s"] for r in mine),
            "quietest_round_tok_s": quietest["tok_s"],
            "quietest_steal": quietest["steal"],
            "max_steal": max(r["steal"] for r in mine),
        }
    ratio = summary["schema"]["median_tok_s"] / summary["free"]["median_tok_s"]
    pairs = [
        next(r["tok_s"] for r in rows if r["round"] == i and r["contender"] == "schema")
        / next(r["tok_s"] for r in rows if r["round"] == i and r["contender"] == "free")
        for i in range(args.rounds)
    ]
    command = "python benchmarks/serve_structured.py " + " ".join(sys.argv[1:])
    lines = [
        cpu_line(),
        f"{MODEL}, {USERS} chat users, temperature 0.7, max_tokens {args.max_tokens}, {args.rounds} rounds each",
        *(
            f"{c:6s}: median {s['median_tok_s']:.1f} tok/s, quietest round {s['quietest_round_tok_s']:.1f} "
            f"(steal {s['quietest_steal']:.1%}), worst steal {s['max_steal']:.1%}"
            for c, s in summary.items()
        ),
        f"schema / free: {ratio:.3f} (medians); per round {statistics.median(pairs):.3f} median of "
        f"{', '.join(f'{p:.2f}' for p in pairs)}",
        f"reproduce: {command}",
    ]
    print("\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    args.out.with_suffix(".json").write_text(
        json.dumps(
            {"cpu": cpu_record(), "rows": rows, "summary": summary, "ratio": ratio, "command": command}, indent=1
        )
    )


if __name__ == "__main__":
    main()
