"""A load test from config to Result: one run, or a find-max search; the Result goes to the
results store (kind "loadtest") with the summary in `metrics`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import httpx

from accelab.loadtest.client import LoadConfig, run_load
from accelab.loadtest.findmax import FindMax, find_max, goodput_at_least
from accelab.loadtest.summary import SLO, summarize_run
from accelab.results.result import Result, command_line

log = logging.getLogger(__name__)


def measure_once(config: LoadConfig, model: str, slo: SLO, rate: float | None = None) -> dict[str, Any]:
    records = run_load(config, model, rate=rate)
    offered = rate if rate is not None else config.rate
    return summarize_run(records, slo, offered_rate=offered)


def search_max_rate(config: LoadConfig, model: str, slo: SLO, *, goodput_target: float, max_steps: int,
                    cooldown_s: float = 2.0,
                    on_probe: Callable[[float, dict[str, Any]], None] | None = None) -> FindMax:
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


def build_result(config: LoadConfig, model: str, slo: SLO, *, summary: dict[str, Any] | None = None,
                 search: FindMax | None = None, goodput_target: float | None = None, tag: str | None = None) -> Result:
    info = server_info(config)
    workload = {
        "scenario": "loadtest", "endpoint": config.endpoint, "url": config.base_url,
        "mode": "closed" if config.concurrency else "open", "rate": config.rate, "concurrency": config.concurrency,
        "burstiness": config.burstiness, "duration_s": config.duration_s, "requests": config.requests,
        "warmup": config.warmup, "max_tokens": config.max_tokens, "stream": config.streams, "slo": slo.to_dict(),
        "find_max": search is not None, "goodput_target": goodput_target, "seed": config.seed,
    }
    metrics: dict[str, Any] = dict(summary or {})
    if search is not None:
        best = next((p.summary for p in search.probes if p.rate == search.best_rate), None)
        metrics = dict(best or {})
        metrics["max_rate"] = search.best_rate
        metrics["search"] = search.to_dict()
        metrics["probes"] = [{"rate": p.rate, "passed": p.passed, **_probe_numbers(p.summary)} for p in search.probes]
    return Result(
        kind="loadtest", status="ok", model={"name": model, "task": info.get("task"), "server": config.base_url},
        plan={"name": info.get("plan", "")}, workload=workload, metrics=metrics, command=command_line(), tag=tag,
        notes=[] if search is None or search.saturated else
        ["the server met the SLO at every rate tried: raise --max-steps or the start --rate"],
    )


def _probe_numbers(summary: dict[str, Any]) -> dict[str, Any]:
    keep = ("goodput_fraction", "goodput_rate", "request_throughput", "output_token_throughput", "errors_by_status")
    out = {k: summary.get(k) for k in keep}
    for key in ("e2e_ms", "ttft_ms"):
        stats = summary.get(key) or {}
        out[key] = {q: stats.get(q) for q in ("p50", "p90", "p99")} if stats else None
    return out
