"""Writes accelab.json, the Grafana dashboard of `accelab serve`, from the panel list below
(the one place to change it; tests/test_monitoring_deploy.py fails when the JSON and this
script disagree). Run: python deploy/grafana/build_dashboard.py (--check: only compare).

Every query filters on the dashboard's $job and $instance variables; behind `--replicas N`
series also carry a `replica` label, which the panels sum over or show.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

OUT = Path(__file__).with_name("accelab.json")
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
S = 'job=~"$job", instance=~"$instance"'  # every selector's filter
API = f'{S}, route!~"models|other"'  # API requests only (not /v1/models, not unknown paths)
# errors the server is answerable for (the alert's, in deploy/prometheus/accelab.rules.yml)
SERVER_ERRORS = f'{S}, kind!~"invalid|too_large|too_long|unauthorized|client_gone"'
RATE = "$__rate_interval"


@dataclass(frozen=True, kw_only=True, slots=True)
class Query:
    expr: str
    legend: str
    instant: bool = False  # a table's current values, not a time series


@dataclass(frozen=True, kw_only=True, slots=True)
class Panel:
    title: str
    description: str
    queries: tuple[Query, ...]
    unit: str = "short"
    kind: str = "timeseries"  # timeseries | stat | gauge | table
    width: int = 8
    thresholds: tuple[tuple[str, float | None], ...] = (("green", None),)


@dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    title: str
    panels: tuple[Panel, ...] = field(default_factory=tuple)


def quantiles(metric: str, by: str = "", *, label: str = "", qs: tuple[float, ...] = (0.5, 0.9, 0.99),
              selector: str = S) -> tuple[Query, ...]:
    """p50/p90/p99 of a histogram over the rate window, summed over `le` (and `by`)."""
    group = f"le, {by}" if by else "le"
    suffix = f" {{{{{by}}}}}" if by else ""
    return tuple(Query(expr=f"histogram_quantile({q:g}, sum by ({group}) (rate({metric}_bucket{{{selector}}}[{RATE}])))",
                       legend=f"{label}p{round(q * 100)}{suffix}") for q in qs)


def mean(metric: str, legend: str = "mean", selector: str = S) -> Query:
    return Query(expr=f"sum(rate({metric}_sum{{{selector}}}[{RATE}])) / sum(rate({metric}_count{{{selector}}}[{RATE}]))",
                 legend=legend)


ROWS = (
    Row(title="Traffic and errors", panels=(
        Panel(title="Requests/s by route", unit="reqps", description="API requests answered per second, by route.",
              queries=(Query(expr=f"sum by (route) (rate(accelab_requests_total{{{API}}}[{RATE}]))", legend="{{route}}"),)),
        Panel(title="Responses/s by status code", unit="reqps",
              description="Every answered request by HTTP status (429 queue full, 504 timeout, 5xx model errors).",
              queries=(Query(expr=f"sum by (status) (rate(accelab_requests_total{{{S}}}[{RATE}]))", legend="{{status}}"),)),
        Panel(title="Errors/s by kind", unit="reqps",
              description="Failed requests by what went wrong (accelab_errors_total), streams that failed mid-answer "
                          "included.",
              queries=(Query(expr=f"sum by (kind) (rate(accelab_errors_total{{{S}}}[{RATE}]))", legend="{{kind}}"),)),
        Panel(title="Server-side error ratio", unit="percentunit", kind="stat", width=6,
              thresholds=(("green", None), ("orange", 0.01), ("red", 0.05)),
              description="Failures the server is answerable for over API requests: the AccelabHighErrorRate alert's "
                          "ratio (5% for 2 min).",
              queries=(Query(expr=f"sum(rate(accelab_errors_total{{{SERVER_ERRORS}}}[{RATE}])) / "
                                  f"sum(rate(accelab_request_latency_seconds_count{{{API}}}[{RATE}]))",
                             legend="error ratio"),)),
        Panel(title="Requests in flight", width=18,
              description="Requests received and not yet answered (queued, running or streaming), per server.",
              queries=(Query(expr=f"sum by (instance) (accelab_requests_in_flight{{{S}}})", legend="{{instance}}"),)),
    )),
    Row(title="Latency", panels=(
        Panel(title="End-to-end latency by route", unit="s", width=12,
              description="Arrival to the last byte, per route (a stream's whole answer).",
              queries=quantiles("accelab_request_latency_seconds", "route", selector=API)),
        Panel(title="Queue and compute time", unit="s", width=12,
              description="Time a request waited for its batch (or its admission), and the run time of its batch.",
              queries=(*quantiles("accelab_queue_time_seconds", label="queue ", qs=(0.5, 0.99)),
                       *quantiles("accelab_compute_time_seconds", label="compute ", qs=(0.5, 0.99)))),
        Panel(title="Time to first token", unit="s",
              description="Arrival to the first generated token (queue and prefill).",
              queries=(*quantiles("accelab_time_to_first_token_seconds"), mean("accelab_time_to_first_token_seconds"))),
        Panel(title="Inter-token latency", unit="s",
              description="Gap between two tokens of one sequence; and each request's mean time per output token.",
              queries=(*quantiles("accelab_inter_token_latency_seconds"),
                       *quantiles("accelab_time_per_output_token_seconds", label="per request ", qs=(0.5,)))),
        Panel(title="Prefill and decode time", unit="s",
              description="Per generated sequence: time to first token less its queue time, and first token to last.",
              queries=(*quantiles("accelab_request_prefill_seconds", label="prefill ", qs=(0.5, 0.99)),
                       *quantiles("accelab_request_decode_seconds", label="decode ", qs=(0.5, 0.99)))),
    )),
    Row(title="Generation", panels=(
        Panel(title="Tokens/s", unit="short",
              description="Generated and prompt tokens per second; and the server's own 10 s window of generated "
                          "tokens.",
              queries=(Query(expr=f"sum(rate(accelab_generated_tokens_total{{{S}}}[{RATE}]))", legend="generated"),
                       Query(expr=f"sum(rate(accelab_prompt_tokens_total{{{S}}}[{RATE}]))", legend="prompt"),
                       Query(expr=f"sum(accelab_generation_tokens_per_second{{{S}}})",
                             legend="generated (server, last 10 s)"))),
        Panel(title="Running and waiting", unit="short",
              description="Sequences decoding in the running batch, sequences waiting for admission, requests queued "
                          "and the queue limit (--max-queue; 429 past it).",
              queries=(Query(expr=f"sum(accelab_running_sequences{{{S}}})", legend="running sequences"),
                       Query(expr=f"sum(accelab_waiting_sequences{{{S}}})", legend="waiting sequences"),
                       Query(expr=f"sum(accelab_queue_depth{{{S}}})", legend="queued"),
                       Query(expr=f"sum(accelab_queue_limit{{{S}}})", legend="queue limit"))),
        Panel(title="KV-cache blocks", unit="short",
              description="KV-cache blocks (16 tokens each) used and free: the capacity admission guards.",
              queries=(Query(expr=f"sum by (state) (accelab_kv_cache_blocks{{{S}}})", legend="{{state}}"),)),
        Panel(title="KV-cache usage", unit="percentunit", kind="gauge", width=6,
              thresholds=(("green", None), ("orange", 0.8), ("red", 0.9)),
              description="Blocks used over all blocks (AccelabKVCacheNearFull fires above 90% for 5 min).",
              queries=(Query(expr=f'sum(accelab_kv_cache_blocks{{{S}, state="used"}}) / '
                                  f"sum(accelab_kv_cache_blocks{{{S}}})", legend="used"),)),
        Panel(title="Finished sequences/s by reason", unit="short", width=9,
              description="stop: end of sequence or a stop string; length: max_tokens reached.",
              queries=(Query(expr=f"sum by (finish_reason) (rate(accelab_finished_sequences_total{{{S}}}[{RATE}]))",
                             legend="{{finish_reason}}"),)),
        Panel(title="Prefix cache and recomputed tokens/s", unit="short", width=9,
              description="Prompt tokens taken from the prefix cache, and tokens of preempted sequences computed "
                          "again.",
              queries=(Query(expr=f"sum(rate(accelab_prefix_cache_tokens_total{{{S}}}[{RATE}]))", legend="from prefix cache"),
                       Query(expr=f"sum(rate(accelab_preempted_tokens_total{{{S}}}[{RATE}]))", legend="recomputed"))),
    )),
    Row(title="Batching", panels=(
        Panel(title="Batch size", unit="short", width=12,
              description="Inputs per model call (with continuous batching, sequences per step), and the limit the "
                          "worker tries now (halved after out-of-memory).",
              queries=(*quantiles("accelab_batch_size", qs=(0.5, 0.99)), mean("accelab_batch_size"),
                       Query(expr=f"max(accelab_batch_size_limit{{{S}}})", legend="limit"))),
        Panel(title="Batch run time", unit="s", width=12,
              description="Run time of one batch (one decoding step with continuous batching).",
              queries=quantiles("accelab_batch_seconds", qs=(0.5, 0.99))),
    )),
    Row(title="Memory", panels=(
        Panel(title="Process memory (RSS)", unit="bytes", width=12,
              description="Resident memory of each server process (each replica's).",
              queries=(Query(expr=f"accelab_process_resident_memory_bytes{{{S}}}", legend="{{instance}} {{replica}}"),)),
        Panel(title="GPU memory", unit="bytes", width=12,
              description="torch.cuda allocated, reserved and peak memory per GPU (only where the server sees one).",
              queries=tuple(Query(expr=f"sum by (instance, device) (accelab_gpu_memory_{kind}_bytes{{{S}}})",
                                  legend=f"{kind} {{{{instance}}}} gpu {{{{device}}}}")
                            for kind in ("allocated", "reserved", "peak"))),
    )),
    Row(title="Replicas and retries", panels=(
        Panel(title="Replicas", unit="short",
              description="Replicas ready and reporting, replicas asked for (--replicas; a plain server counts as "
                          "one), and scrape targets up.",
              queries=(Query(expr=f"sum(accelab_ready{{{S}}})", legend="ready"),
                       Query(expr=f"count(accelab_ready{{{S}}})", legend="reporting"),
                       Query(expr=f"sum(max by (job, instance) (accelab_replicas_configured{{{S}}}) or "
                                  f"count by (job, instance) (accelab_ready{{{S}}}))", legend="configured"),
                       Query(expr=f"sum(up{{{S}}})", legend="targets up"))),
        Panel(title="Retries/s by cause", unit="short",
              description="Work done twice: batches split after an error or out-of-memory, sequences preempted, "
                          "requests retried on another replica (AccelabRetries).",
              queries=(Query(expr=f"sum by (reason) (rate(accelab_batch_retries_total{{{S}}}[{RATE}]))",
                             legend="split batch ({{reason}})"),
                       Query(expr=f"sum(rate(accelab_preemptions_total{{{S}}}[{RATE}]))", legend="preempted sequences"),
                       Query(expr=f"sum(rate(accelab_replica_retries_total{{{S}}}[{RATE}])) or vector(0)",
                             legend="replica retries"))),
        Panel(title="Model served", kind="table",
              description="Model, plan and device of each server (accelab_model_info).",
              queries=(Query(expr=f"max by (instance, model, plan, device) (accelab_model_info{{{S}}})",
                             legend="{{model}}", instant=True),)),
    )),
)


def panel_json(panel: Panel, pid: int, x: int, y: int) -> dict:
    targets = [{"datasource": DATASOURCE, "editorMode": "code", "expr": q.expr, "legendFormat": q.legend,
                "range": not q.instant, "instant": q.instant, "refId": chr(ord("A") + i),
                **({"format": "table"} if q.instant else {})} for i, q in enumerate(panel.queries)]
    steps = [{"color": color, "value": value} for color, value in panel.thresholds]
    doc = {"id": pid, "type": panel.kind, "title": panel.title, "description": panel.description,
           "datasource": DATASOURCE, "gridPos": {"h": 8, "w": panel.width, "x": x, "y": y},
           "fieldConfig": {"defaults": {"unit": panel.unit, "thresholds": {"mode": "absolute", "steps": steps}},
                           "overrides": []},
           "targets": targets}
    if panel.kind == "timeseries":
        doc["fieldConfig"]["defaults"]["min"] = 0
        doc["options"] = {"legend": {"calcs": [], "displayMode": "list", "placement": "bottom", "showLegend": True},
                          "tooltip": {"mode": "multi", "sort": "desc"}}
    elif panel.kind in ("stat", "gauge"):
        if panel.unit == "percentunit":
            doc["fieldConfig"]["defaults"].update(min=0, max=1)
        reduce = {"calcs": ["lastNotNull"], "fields": "", "values": False}
        doc["options"] = ({"reduceOptions": reduce, "colorMode": "value", "graphMode": "area", "textMode": "auto",
                           "orientation": "auto", "justifyMode": "auto"} if panel.kind == "stat" else
                          {"reduceOptions": reduce, "showThresholdLabels": False, "showThresholdMarkers": True,
                           "orientation": "auto"})
    else:  # table: one row per server, the labels as columns
        doc["options"] = {"showHeader": True}
        doc["transformations"] = [{"id": "organize", "options": {"excludeByName": {"Time": True, "Value": True}}}]
    return doc


def variable(name: str, query: str) -> dict:
    return {"type": "query", "name": name, "label": name, "datasource": DATASOURCE,
            "query": {"query": query, "refId": name}, "includeAll": True, "allValue": ".+", "multi": True,
            "refresh": 2, "sort": 1, "hide": 0, "regex": "", "options": [], "current": {}}


def dashboard() -> dict:
    panels: list[dict] = []
    pid, y = 1, 0
    for row in ROWS:
        panels.append({"id": pid, "type": "row", "title": row.title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y, x = pid + 1, y + 1, 0
        for panel in row.panels:
            if x + panel.width > 24:
                x, y = 0, y + 8
            panels.append(panel_json(panel, pid, x, y))
            pid, x = pid + 1, x + panel.width
        y += 8
    return {
        "title": "accelab serve", "uid": "accelab-serve", "description": "accelab serve: traffic, errors, latency, "
        "generation, KV cache, batching, memory, replicas and retries (deploy/README.md).",
        "tags": ["accelab", "llm", "serving"], "editable": True, "graphTooltip": 1, "schemaVersion": 39,
        "version": 1, "refresh": "10s", "time": {"from": "now-30m", "to": "now"}, "timezone": "browser",
        "fiscalYearStartMonth": 0, "liveNow": False, "weekStart": "", "links": [],
        "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                                  "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                                  "name": "Annotations & Alerts", "type": "dashboard"}]},
        "templating": {"list": [
            {"type": "datasource", "name": "datasource", "label": "Prometheus", "query": "prometheus",
             "hide": 0, "refresh": 1, "regex": "", "options": [], "current": {}},
            variable("job", "label_values(accelab_ready, job)"),
            variable("instance", 'label_values(accelab_ready{job=~"$job"}, instance)'),
        ]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:  # the test's: is accelab.json what this script writes?
        if OUT.read_text() != render():
            sys.exit(f"{OUT} differs from what {Path(__file__).name} writes: run python {__file__}")
    else:
        OUT.write_text(render())
        print(f"wrote {OUT}")
