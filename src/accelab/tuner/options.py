"""What `accelab tune MODEL` takes: each field of TuneOptions declares its option, and the
builders make the request of the scenario asked (`tune_request`: a plan search call by call;
`serve_tune_request`: candidate servers under load).

TuneOptions is its own light dataclass because the requests it becomes live in modules that load
torch (`tuner.run`) or httpx (`tuner.serving`), and the command line must not import them at
start-up. A field of TuneOptions sets the request field of its name (`window` sets
ServeTuneRequest's `window_s`); the builders convert the others (`task` resolves the model,
`include` / `exclude` are split at commas, `concurrency` and `slo` parsed, `prompt_file` read).
tests/test_command_options.py checks both mappings and the defaults against the requests'.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from accelab.options import as_choice, fields_of, option

if TYPE_CHECKING:
    from accelab.tuner.run import TuneRequest
    from accelab.tuner.serving import ServeTuneRequest

SERVE_ONLY = "--scenario serve: "
# TuneOptions fields that the builders convert rather than copy into a request field of their name
CONVERTED: Final = frozenset({"task", "include", "exclude", "concurrency", "slo", "prompt_file", "max_tokens"})
RENAMED: Final = {"window": "window_s"}  # option -> ServeTuneRequest field


@dataclass(frozen=True, kw_only=True, slots=True)
class TuneOptions:
    """The options of `accelab tune`. goal, percentile and quality are checked by `check_options`
    (`tuner.run`) before the model is resolved; scenario by the request it becomes."""

    goal: str = field(default="throughput", metadata=option("throughput | latency."))
    percentile: str = field(default="p99", metadata=option("For --goal latency: p50 | p99."))
    task: str | None = field(default=None, metadata=option())
    scenario: str = field(
        default="auto",
        metadata=option(
            "forward | generate | auto: plans measured call by call; serve: candidate servers "
            "measured under --concurrency users (with --slo, --rounds, --window, --prompt-file)."
        ),
    )
    batch_size: int | None = field(
        default=None,
        metadata=option(
            "Latency goal: the request batch (default 1). "
            "Throughput goal: the screening batch (default 8 forward, 4 generate).",
            "--batch-size",
            "-b",
        ),
    )
    max_batch: int | None = field(
        default=None, metadata=option("Largest batch tried (default 256 forward, 64 generate).")
    )
    seq_len: int = field(default=128, metadata=option())
    new_tokens: int = field(default=32, metadata=option())
    image_size: int | None = field(default=None, metadata=option())
    max_memory: str | None = field(
        default=None, metadata=option("Peak memory limit: GPU memory, or process RSS on CPU (e.g. 2GiB).")
    )
    p99_ms: float | None = field(default=None, metadata=option("p99 latency SLA per call, in ms."))
    quality: str = field(
        default="balanced",
        metadata=option("strict | balanced | loose | off: the verify tolerance every plan must meet."),
    )
    budget: str | None = field(
        default=None, metadata=option("Wall time for the whole search (e.g. 10m); the best so far wins.")
    )
    include: str | None = field(
        default=None, metadata=option("Comma-separated presets to search instead of the default space.")
    )
    exclude: str | None = field(default=None, metadata=option("Comma-separated presets to leave out."))
    min_seconds: float = field(default=3.0, metadata=option("Length of the final runs."))
    device: str | None = field(default=None, metadata=option())
    out: Path = field(default=Path("best.yaml"), metadata=option("Where to write the winning Plan."))
    plot: Path | None = field(default=None, metadata=option("Pareto chart PNG (throughput vs p99, memory as colour)."))
    json_out: Path | None = field(default=None, metadata=option(None, "--json"))
    db: Path | None = field(default=None, metadata=option())
    fresh: bool = field(
        default=False, metadata=option("Ignore earlier measurements of the same tune in the store.", "--fresh")
    )
    concurrency: str = field(default="8", metadata=option(SERVE_ONLY + "closed-loop users, or levels such as 1,8,16."))
    slo: str | None = field(
        default=None,
        metadata=option(
            SERVE_ONLY + "per-request objectives, e.g. ttft_p99=500ms,itl_p99=100ms "
            "(ttft, itl, e2e); goodput counts the output tokens of requests that meet them all."
        ),
    )
    prompt_file: Path | None = field(
        default=None, metadata=option(SERVE_ONLY + "your prompts, a JSON list of strings or one per line.")
    )
    rounds: int = field(default=2, metadata=option(SERVE_ONLY + "rounds of windows per load (A B C ... C B A)."))
    window: float = field(default=15.0, metadata=option(SERVE_ONLY + "seconds of load per window."))
    max_tokens: str | None = field(
        default=None,
        metadata=option(
            SERVE_ONLY + "the answers' max_tokens: one value, or a mix that successive requests take in turn "
            "(e.g. 16,64); default chat's mix of 16-128."
        ),
    )


def tune_request(model: str, options: TuneOptions) -> TuneRequest:
    """The plan search `options` ask for, checked before the model is resolved (downloaded)."""
    from accelab.catalog.resolve import resolve
    from accelab.tuner.run import GOALS, PERCENTILES, TUNE_SCENARIOS, TuneRequest
    from accelab.tuner.search import QUALITY_LEVELS

    _check(options)
    return TuneRequest(
        spec=resolve(model, options.task),
        goal=as_choice(options.goal, GOALS),
        percentile=as_choice(options.percentile, PERCENTILES),
        scenario=as_choice(options.scenario, TUNE_SCENARIOS),
        quality=as_choice(options.quality, QUALITY_LEVELS),
        include=_split(options.include),
        exclude=_split(options.exclude),
        **_copied(TuneRequest, options, skip={"goal", "percentile", "scenario", "quality"}),
    )


def serve_tune_request(model: str, options: TuneOptions) -> ServeTuneRequest:
    """The server search (`--scenario serve`) `options` ask for."""
    from accelab.catalog.resolve import resolve
    from accelab.loadtest.run import load_inputs
    from accelab.tuner.serve_request import MAX_TOKENS_MIX, parse_max_tokens
    from accelab.tuner.serving import ServeTuneRequest, parse_levels, parse_serve_slo

    _check(options)
    prompt_file = options.prompt_file
    return ServeTuneRequest(
        spec=resolve(model, options.task),
        model=model,
        concurrency=parse_levels(options.concurrency),
        slo=parse_serve_slo(options.slo),
        include=tuple(_split(options.include) or ()) or None,
        exclude=tuple(_split(options.exclude) or ()),
        prompts=tuple(load_inputs("chat", prompt_file)) if prompt_file else (),
        max_tokens=parse_max_tokens(options.max_tokens) if options.max_tokens else MAX_TOKENS_MIX,
        **_copied(ServeTuneRequest, options),
    )


def _check(options: TuneOptions) -> None:
    from accelab.tuner.run import check_options

    check_options(
        goal=options.goal,
        percentile=options.percentile,
        quality=options.quality,
        max_memory=options.max_memory,
        budget=options.budget,
    )


def _copied(request: type, options: TuneOptions, *, skip: frozenset[str] | set[str] = frozenset()) -> dict[str, Any]:
    """The fields of `request` that an option of their name sets as it was typed."""
    given = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    return fields_of(request, given, renamed=RENAMED, skip={*CONVERTED, *skip})


def _split(text: str | None) -> list[str] | None:
    return [p.strip() for p in text.split(",") if p.strip()] if text else None
