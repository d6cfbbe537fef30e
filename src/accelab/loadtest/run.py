"""A load test from request to Result: one run, or a find-max search, printed and plotted as
asked; the Result (kind "loadtest") holds the summary in `metrics` (keys:
`accelab.results.contract.LOADTEST`, and `FIND_MAX` after a search). `accelab loadtest` is a thin
adapter over `run_loadtest`."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import httpx
from rich.table import Table

from accelab.loadtest import client
from accelab.loadtest.client import LoadConfig, discover_model, parse_max_tokens, run_load
from accelab.loadtest.findmax import FindMax, find_max, goodput_at_least
from accelab.loadtest.images import load_images
from accelab.loadtest.plot import plot_cdf, plot_find_max
from accelab.loadtest.summary import SLO, parse_slo, summarize_run
from accelab.options import fields_of
from accelab.results import contract as K
from accelab.results.result import Result, command_line
from accelab.results.table import make_console

log = logging.getLogger(__name__)


def measure_once(config: LoadConfig, model: str, slo: SLO, rate: float | None = None) -> dict[str, Any]:
    records = run_load(config, model, rate=rate)
    offered = rate if rate is not None else config.rate
    return summarize_run(records, slo, offered_rate=offered)


def search_max_rate(
    config: LoadConfig,
    model: str,
    slo: SLO,
    *,
    goodput_target: float,
    max_steps: int,
    cooldown_s: float = 2.0,
    on_probe: Callable[[float, dict[str, Any]], None] | None = None,
) -> FindMax:
    """find-max with real measurements; `cooldown_s` of quiet between probes lets a server that
    a failing probe overloaded shed its backlog before the next one (or it would fail too)."""
    probes = 0

    def measure(rate: float) -> dict[str, Any]:
        nonlocal probes
        if probes and cooldown_s > 0:
            time.sleep(cooldown_s)
        probes += 1
        summary = measure_once(config, model, slo, rate)
        if on_probe:
            on_probe(rate, summary)
        return summary

    return find_max(measure, goodput_at_least(goodput_target), start_rate=config.rate or 1.0, max_steps=max_steps)


def server_info(config: LoadConfig) -> dict[str, Any]:
    """What /v1/models says (accelab adds task and plan); {} for servers that say little."""
    try:
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        data = httpx.get(f"{config.base_url}/v1/models", headers=headers, timeout=10).json()["data"][0]
        return {k: data[k] for k in ("id", "task", "plan", "owned_by") if k in data}
    except Exception:  # noqa: BLE001 - informational only
        return {}


def build_result(
    config: LoadConfig,
    model: str,
    slo: SLO,
    *,
    summary: dict[str, Any] | None = None,
    search: FindMax | None = None,
    goodput_target: float | None = None,
    tag: str | None = None,
) -> Result:
    info = server_info(config)
    workload = {
        "scenario": "loadtest",
        "endpoint": config.endpoint,
        "url": config.base_url,
        "mode": "closed" if config.concurrency else "open",
        "rate": config.rate,
        "concurrency": config.concurrency,
        "burstiness": config.burstiness,
        "duration_s": config.duration_s,
        "requests": config.requests,
        "warmup": config.warmup,
        "max_tokens": config.max_tokens,
        "stream": config.streams,
        "slo": slo.to_dict(),
        "find_max": search is not None,
        "goodput_target": goodput_target,
        "seed": config.seed,
    }
    metrics: dict[str, Any] = dict(summary or {})
    if search is not None:
        best = next((p.summary for p in search.probes if p.rate == search.best_rate), None)
        metrics = dict(best or {})
        metrics[K.MAX_RATE] = search.best_rate
        metrics[K.SEARCH] = search.to_dict()
        metrics[K.PROBES] = [{K.RATE: p.rate, K.PASSED: p.passed, **_probe_numbers(p.summary)} for p in search.probes]
    return Result(
        kind="loadtest",
        status="ok",
        model={"name": model, "task": info.get("task"), "server": config.base_url},
        plan={"name": info.get("plan", "")},
        workload=workload,
        metrics=metrics,
        command=command_line(),
        tag=tag,
        notes=[]
        if search is None or search.saturated
        else ["the server met the SLO at every rate tried: raise --max-steps or the start --rate"],
    )


def _probe_numbers(summary: dict[str, Any]) -> dict[str, Any]:
    keep = (K.GOODPUT_FRACTION, K.GOODPUT_RATE, K.REQUEST_THROUGHPUT, K.OUTPUT_TOKEN_THROUGHPUT, K.ERRORS_BY_STATUS)
    out = {k: summary.get(k) for k in keep}
    for key in (K.E2E_MS, K.TTFT_MS):
        stats = summary.get(key) or {}
        out[key] = {q: stats.get(q) for q in ("p50", "p90", "p99")} if stats else None
    return out


# -- the whole load test --------------------------------------------------------------------------
# `accelab loadtest` options named apart from the LoadTestRequest field they set
OPTION_FIELDS: Final = {"find_max_": "find_max", "cooldown": "cooldown_s"}


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadTestRequest:
    config: LoadConfig
    slo: SLO
    find_max: bool = False  # search the highest rate whose goodput meets goodput_target
    goodput_target: float = 0.95
    max_steps: int = 8  # most runs of a search
    cooldown_s: float = 2.0  # quiet between the runs of a search
    plot: Path | None = None  # PNG: latency CDF (one run) or latency and goodput against load (find-max)
    tag: str | None = None

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> LoadTestRequest:
        """What `accelab loadtest`'s options (its parameters by name) ask for: the SLO, the loop
        (`loop_of`), the inputs and the max_tokens list are made from the options of those names."""
        slo = parse_slo(options["slo"])
        rate, concurrency = loop_of(options["rate"], options["concurrency"], find_max=options["find_max_"], slo=slo)
        config = LoadConfig(
            **fields_of(LoadConfig, options, renamed=client.OPTION_FIELDS, skip=client.FROM_OTHER_OPTIONS),
            inputs=tuple(load_inputs(options["endpoint"], options["prompts_file"])),
            rate=rate,
            concurrency=concurrency,
            max_tokens=parse_max_tokens(options["max_tokens"]),
            images=load_images(options["images"], seed=options["seed"]),
        )
        return cls(config=config, slo=slo, **fields_of(cls, options, renamed=OPTION_FIELDS, skip={"config", "slo"}))


def loop_of(
    rate: float | None, concurrency: int | None, *, find_max: bool, slo: SLO
) -> tuple[float | None, int | None]:
    """(rate, concurrency): open loop at `rate` or closed loop of `concurrency` users; one user
    when neither is given, or 1 req/s as the start of a find-max search."""
    if find_max and not slo.to_dict():
        raise ValueError("--find-max needs an --slo to meet, e.g. --slo ttft=500ms,e2e=2s")
    if find_max and concurrency is not None:
        raise ValueError("--find-max searches an open-loop --rate; drop --concurrency")
    if rate is None and concurrency is None:
        return (1.0, None) if find_max else (None, 1)
    return rate, concurrency


def load_inputs(endpoint: str, path: Path | None) -> list[str]:
    """The inputs to send: a JSON list of strings or one per line, else accelab's samples."""
    if path is not None:
        text = path.read_text()
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            items = [line for line in text.splitlines() if line.strip()]
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise ValueError(f"{path}: give a JSON list of strings, or one input per line")
        return items
    from accelab.catalog import inputs

    return inputs.sentences(224) if endpoint == "embeddings" else inputs.prompts(52)


def run_loadtest(request: LoadTestRequest, console: Any = None) -> Result:
    """One run, or a find-max search, against the server; printed, plotted as asked, not stored."""
    console = console or make_console()
    config, objectives = request.config, request.slo
    served = discover_model(config)
    if request.find_max:
        return _find_max(request, served, console)
    records = run_load(config, served)
    summary = summarize_run(records, objectives, offered_rate=config.rate)
    result = build_result(config, served, objectives, summary=summary, tag=request.tag)
    print_summary(console, summary)
    if request.plot:
        ok = [r for r in records if r.ok]
        plot_cdf(
            {"e2e": [r.e2e * 1000 for r in ok], "TTFT": [r.ttft * 1000 for r in ok if r.ttft is not None]},
            request.plot,
            title=f"{served} {config.endpoint}: latency CDF",
        )
    return result


def _find_max(request: LoadTestRequest, served: str, console: Any) -> Result:
    config, objectives = request.config, request.slo

    def show(rate_: float, summary: dict[str, Any]) -> None:
        console.print(
            f"  {rate_:8.3g} req/s: goodput {summary[K.GOODPUT_FRACTION]:.1%}, "
            f"{summary[K.REQUEST_THROUGHPUT]:.3g} req/s served, e2e p99 {_p(summary, K.E2E_MS)} ms, "
            f"errors {summary[K.ERRORS_BY_STATUS] or 0}"
        )

    console.print(
        f"find-max on {config.base_url} ({served}, {config.endpoint}), SLO {objectives.describe()}, "
        f"goodput >= {request.goodput_target:.0%}:"
    )
    search = search_max_rate(
        config,
        served,
        objectives,
        goodput_target=request.goodput_target,
        max_steps=request.max_steps,
        cooldown_s=request.cooldown_s,
        on_probe=show,
    )
    result = build_result(
        config, served, objectives, search=search, goodput_target=request.goodput_target, tag=request.tag
    )
    best = "none (not even the lowest rate tried)" if search.best_rate is None else f"{search.best_rate:.4g} req/s"
    console.print(
        f"max sustainable rate: [bold]{best}[/bold]"
        + ("" if search.saturated else " (never saturated: raise --max-steps)")
    )
    if request.plot:
        plot_find_max(
            result.metrics[K.PROBES],
            request.plot,
            best_rate=search.best_rate,
            title=f"{served} {config.endpoint}: latency and goodput vs load",
        )
    return result


def _p(summary: dict[str, Any], key: str, q: str = "p99") -> str:
    stats = summary.get(key)
    return f"{stats[q]:.4g}" if stats else "-"


def print_summary(console: Any, s: dict[str, Any]) -> None:
    table = Table(title="load test", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("requests (ok / errors)", f"{s[K.OK_REQUESTS]} / {s[K.ERRORS]}  {s[K.ERRORS_BY_STATUS] or ''}")
    table.add_row("duration", f"{s[K.DURATION_S]:.2f} s")
    table.add_row("request throughput", f"{s[K.REQUEST_THROUGHPUT]:.3f} req/s")
    table.add_row("output token throughput", f"{s[K.OUTPUT_TOKEN_THROUGHPUT]:.1f} tok/s")
    for key, label in ((K.TTFT_MS, "TTFT"), (K.TPOT_MS, "TPOT"), (K.ITL_MS, "ITL"), (K.E2E_MS, "end-to-end")):
        if s.get(key):
            table.add_row(
                f"{label} p50 / p90 / p99", " / ".join(f"{s[key][q]:.4g}" for q in ("p50", "p90", "p99")) + " ms"
            )
    if s[K.SLO]:
        table.add_row("goodput", f"{s[K.GOODPUT_FRACTION]:.1%} of requests, {s[K.GOODPUT_RATE]:.3f} req/s")
    console.print(table)
