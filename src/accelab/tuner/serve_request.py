"""What a serving tune is asked (`accelab tune MODEL --scenario serve`): the load (users per
level, prompts, the mix of answer lengths), the SLO each request is held to, the memory and
quality limits, and the server settings every candidate runs with. Parsing and validation
only: no server is started here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from accelab.catalog.spec import ModelSpec
from accelab.loadtest.summary import SLO
from accelab.quality.verdict import LEVELS
from accelab.units import parse_objectives, parse_size_mib

MAX_TOKENS_MIX = (16, 128, 32, 96, 64, 128, 24, 80)  # max_tokens of successive requests: chat's mix
SLO_NAMES = {"ttft": "ttft", "itl": "tpot", "tpot": "tpot", "e2e": "e2e"}  # --slo name -> per-request limit
GENERATION_TASKS = ("text-generation", "image-text-to-text")


def parse_serve_slo(text: str | None) -> SLO:
    """'ttft_p99=500ms,itl_p99=100ms' (or ttft=, itl=, tpot=, e2e=) -> per-request limits: a
    request meets the SLO when its TTFT, its mean time per output token after the first (ITL)
    and its whole time are each within their limit; a percentile suffix says which share of the
    requests the user expects to meet it, which goodput reports."""
    if not text:
        return SLO()
    names = {f"{k}{suffix}": v for k, v in SLO_NAMES.items() for suffix in ("", "_p99")}
    parsed = parse_objectives(text, tuple(names), "--slo")
    limits: dict[str, float] = {}
    for name, seconds in parsed.items():
        limits[names[name]] = min(seconds, limits.get(names[name], seconds))
    return SLO(**limits)


def parse_levels(text: str) -> tuple[int, ...]:
    return tuple(sorted(set(_positive_ints(text, "--concurrency", "1 or more users", "8, or 1,8,16"))))


def parse_max_tokens(text: str) -> tuple[int, ...]:
    """'64' or '16,64,128' -> the max_tokens successive requests ask for, in turn."""
    return _positive_ints(text, "--max-tokens", "1 token or more", "64, or 16,64")


def _positive_ints(text: str, option: str, at_least: str, example: str) -> tuple[int, ...]:
    """Comma-separated whole numbers of 1 or more, as typed for `option`, in order."""
    try:
        values = tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise ValueError(f"{option} {text!r} must be whole numbers, comma-separated (e.g. {example})") from None
    if not values or min(values) < 1:
        raise ValueError(f"{option} {text!r} must be {at_least} (e.g. {example})")
    return values


@dataclass(frozen=True, kw_only=True, slots=True)
class ServeTuneRequest:
    spec: ModelSpec
    model: str  # as `accelab serve` takes it: the catalog name, a directory, a Hub id
    concurrency: tuple[int, ...] = (8,)
    slo: SLO = SLO()
    max_memory: str | None = None  # peak RSS of a server's processes (GPU memory is not watched here)
    quality: str = "balanced"  # verify's tolerance, or "off"
    include: tuple[str, ...] | None = None
    exclude: tuple[str, ...] = ()
    prompts: tuple[str, ...] = ()  # empty: accelab's sample prompts
    max_tokens: tuple[int, ...] = MAX_TOKENS_MIX
    rounds: int = 2
    window_s: float = 15.0
    ready_timeout_s: float = 900.0
    device: str | None = None
    out: Path | None = None
    json_out: Path | None = None
    db: str | Path | None = None
    fresh: bool = False

    def __post_init__(self) -> None:
        if self.spec.task not in GENERATION_TASKS:
            raise ValueError(
                f"tune --scenario serve measures generation servers (chat under load); {self.spec.name} is "
                f"{self.spec.task}: tune it with --scenario forward, or load-test its server with `accelab loadtest`"
            )
        if self.quality not in (*LEVELS, "off"):
            raise ValueError(f"--quality {self.quality!r} must be one of strict, balanced, loose, off")
        if self.rounds < 1 or self.window_s <= 0:
            raise ValueError(f"--rounds {self.rounds} and --window {self.window_s} must be positive")
        if self.max_memory:
            parse_size_mib(self.max_memory, "--max-memory")

    @property
    def settings(self) -> dict[str, int]:
        """The server settings every candidate runs with (and the winner's Plan keeps): a
        sequence slot for every user, and twice that in tokens per step (at least 256)."""
        batch = max(self.concurrency)
        return {"max_batch_size": batch, "max_step_tokens": max(256, 2 * batch)}
