"""What `accelab loadtest URL` takes: each field of LoadOptions declares its option.

LoadOptions is the command line's light table of the load test: the configs its options end in,
LoadConfig (`loadtest.client`) and LoadTestRequest (`loadtest.run`), live in modules that load
httpx and aiohttp, which `accelab --help` must not import. `LoadTestRequest.from_options` makes
them from these options by name (`OPTION_FIELDS` of both modules: the options named apart from
their field), parsing --max-tokens, --slo, --images and the loop; tests/test_command_options.py
checks every option against the field it sets and its default against that field's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from accelab.options import option


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadOptions:
    """The load, the requests, the SLO and its search; where the Result goes is `Output`."""

    endpoint: str = field(default="chat", metadata=option("chat | completions | embeddings."))
    model: str | None = field(default=None, metadata=option("Model id to send (default: the first of /v1/models)."))
    rate: float | None = field(
        default=None, metadata=option("Open loop: requests per second (the start rate of --find-max).")
    )
    concurrency: int | None = field(
        default=None, metadata=option("Closed loop: users, each sending its next request when the last one answered.")
    )
    burstiness: float = field(
        default=1.0, metadata=option("Open-loop arrivals: gamma shape; 1 = Poisson, <1 burstier.")
    )
    duration: float = field(  # LoadConfig.duration_s
        default=30.0, metadata=option("Seconds of sending per run (each find-max probe is one run).")
    )
    requests: int | None = field(
        default=None, metadata=option("Most requests per run (with --duration, whichever first).")
    )
    warmup: int = field(default=2, metadata=option("Requests sent first and left out of the numbers."))
    max_tokens: str = field(  # parsed into LoadConfig.max_tokens: "16,128" -> (16, 128)
        default="32",
        metadata=option(
            "max_tokens of each generation request; a list "
            "(16,128,32,96) mixes short and long answers, request i asking for item i mod n.",
            "--max-tokens",
        ),
    )
    stream: bool = field(
        default=True, metadata=option("Stream generations (needed for TTFT/ITL).", "--stream/--no-stream")
    )
    timeout: float = field(  # LoadConfig.timeout_s
        default=60.0, metadata=option("Seconds before one request counts as failed.")
    )
    slo: str | None = field(
        default=None,
        metadata=option(
            "Per-request objectives, e.g. ttft=500ms,e2e=2s (keys: ttft, "
            "tpot, e2e); goodput counts requests meeting all."
        ),
    )
    find_max_: bool = field(  # LoadTestRequest.find_max
        default=False,
        metadata=option(
            "Search the highest rate whose goodput meets --goodput-target (doubling, then bisection).", "--find-max"
        ),
    )
    goodput_target: float = field(
        default=0.95, metadata=option("Fraction of requests that must meet the SLO for a rate to pass.")
    )
    max_steps: int = field(default=8, metadata=option("Most runs a --find-max search makes."))
    cooldown: float = field(  # LoadTestRequest.cooldown_s
        default=2.0, metadata=option("Seconds of quiet between --find-max runs (the server sheds a backlog).")
    )
    max_in_flight: int = field(
        default=1024,
        metadata=option(
            "Open loop: an arrival finding this many "
            "requests unanswered fails at once instead of opening another connection."
        ),
    )
    prompts_file: Path | None = field(  # read into LoadConfig.inputs
        default=None,
        metadata=option(
            "Inputs to send: a JSON list of strings or one per line (default: accelab's sample prompts / sentences)."
        ),
    )
    images: str | None = field(  # loaded into LoadConfig.images
        default=None,
        metadata=option(
            "Chat: send images after each prompt: sample[:N] (accelab's photos, a repeated pool), "
            "generated[:N] (distinct random images) or a folder of PNG / JPEG / WebP files."
        ),
    )
    images_per_request: int = field(default=1, metadata=option("Images in each chat request."))
    images_every: int = field(
        default=1,
        metadata=option("With --images: every Nth chat request carries images, the others are text only (mixed)."),
    )
    api_key: str | None = field(default=None, metadata=option(None, envvar="ACCELAB_API_KEY"))
    seed: int = field(default=0, metadata=option("Seed of the arrival schedule."))
    plot: Path | None = field(
        default=None,
        metadata=option("PNG: latency CDF (one run) or latency and goodput against offered load (--find-max)."),
    )
