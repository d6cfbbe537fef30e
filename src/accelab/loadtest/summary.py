"""Per-request records to a run's summary: latency percentiles, throughput, errors, goodput.
Pure: no I/O, no clock. The summary's keys are `accelab.results.contract.LOADTEST`."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from accelab.measure.stats import summarize
from accelab.results import contract as K
from accelab.units import parse_objectives

SLO_KEYS = ("ttft", "tpot", "e2e")


@dataclass(kw_only=True, slots=True)
class RequestRecord:
    """One request as the client saw it; times in seconds from the start of the run."""

    start: float
    end: float
    status: str  # "200", "429", ..., or "error:<ExceptionName>"
    ttft: float | None = None  # first content, seconds after start (streams only)
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None
    images: int = 0  # images the request sent (chat)

    @property
    def ok(self) -> bool:
        return self.status == "200" and self.error is None

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Inter-token latency: one value per generated token after the first. A streamed chunk
        can carry several tokens (a server holds text back while it could still be a stop
        string or half a character, or sends several tokens at once), so each gap between two
        chunks is spread over the tokens that arrived with it, as the usage count tells: the
        tokens after the first chunk, split evenly over the gaps. Without a usage count, one
        token per chunk."""
        gaps = [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]
        per_gap = (self.output_tokens - 1) / len(gaps) if gaps else 0.0
        if per_gap <= 1:
            return gaps
        spread = []
        for i, gap in enumerate(gaps):
            n = round((i + 1) * per_gap) - round(i * per_gap)  # sums to output_tokens - 1
            spread.extend([gap / n] * n)
        return spread


@dataclass(frozen=True, kw_only=True, slots=True)
class SLO:
    """Per-request latency objectives, seconds; None: not constrained."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        # a response that is not streamed has its first token when it all arrives
        ttft = record.ttft if record.ttft is not None else record.e2e
        checks = ((self.ttft, ttft), (self.tpot, record.tpot or 0.0), (self.e2e, record.e2e))
        return all(limit is None or value <= limit for limit, value in checks)

    def to_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in SLO_KEYS if getattr(self, k) is not None}

    def describe(self) -> str:
        return ",".join(f"{k}={v * 1000:g}ms" for k, v in self.to_dict().items()) or "none"


def parse_slo(text: str | None) -> SLO:
    """'ttft=500ms,e2e=2s' -> SLO(ttft=0.5, e2e=2.0); bare numbers are seconds."""
    return SLO(**parse_objectives(text, SLO_KEYS, "--slo"))


def summarize_run(records: list[RequestRecord], slo: SLO, *, offered_rate: float | None = None) -> dict[str, Any]:
    """The run's numbers. Latencies in ms; throughput per second of the run's wall time (first
    send to last answer); goodput counts requests that succeeded AND met every SLO."""
    if not records:
        raise ValueError("no requests were measured; raise --requests or --duration")
    ok = [r for r in records if r.ok]
    wall = max(r.end for r in records) - min(r.start for r in records)
    wall = wall if wall > 0 else float("nan")
    good = sum(slo.met_by(r) for r in records)

    def stats(values: list[float]) -> dict[str, float] | None:
        return summarize([v * 1000 for v in values]).to_dict() if values else None

    output_tokens = sum(r.output_tokens for r in ok)
    return {
        K.REQUESTS: len(records),
        K.OK_REQUESTS: len(ok),
        K.ERRORS: len(records) - len(ok),
        K.ERRORS_BY_STATUS: dict(Counter(r.status for r in records if not r.ok)),
        K.DURATION_S: wall,
        K.OFFERED_RATE: offered_rate,
        K.REQUEST_THROUGHPUT: len(ok) / wall,
        K.OUTPUT_TOKEN_THROUGHPUT: output_tokens / wall,
        K.OUTPUT_TOKENS: output_tokens,
        K.PROMPT_TOKENS: sum(r.prompt_tokens for r in ok),
        K.E2E_MS: stats([r.e2e for r in ok]),
        K.TTFT_MS: stats([r.ttft for r in ok if r.ttft is not None]),
        K.TPOT_MS: stats([t for r in ok if (t := r.tpot) is not None]),
        K.ITL_MS: stats([gap for r in ok for gap in r.itls]),
        K.SLO: slo.to_dict(),
        K.GOODPUT_FRACTION: good / len(records),
        K.GOODPUT_RATE: good / wall,
        K.GOOD_REQUESTS: good,
    }
