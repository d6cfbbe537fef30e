"""`accelab top URL`: a live view of a running server, for a person at a terminal.

Every `--interval` seconds it reads URL/metrics, keeps the scrapes of the last `--window`
seconds, and redraws two tables: what happened in the window (rates, percentiles of the
observations in it) beside the same since the server started, and the state right now (queue,
running sequences, KV cache, memory, replicas). Percentiles come from the server's histograms,
computed as Prometheus computes them (`accelab.monitor.scrape`). Ctrl+C quits.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from accelab.monitor.scrape import NOT_API, Snapshot, Window, api_requests, quantile, top_kinds

log = logging.getLogger(__name__)

LATENCIES = (
    ("latency", "accelab_request_latency_seconds", {"route": NOT_API}, False),
    ("time to first token", "accelab_time_to_first_token_seconds", None, True),
    ("inter-token latency", "accelab_inter_token_latency_seconds", None, True),
)
RETRIES = (
    ("split batch", "accelab_batch_retries_total"),
    ("preemption", "accelab_preemptions_total"),
    ("replica", "accelab_replica_retries_total"),
)


@dataclass(frozen=True, kw_only=True, slots=True)
class TopOptions:
    url: str  # the server's base URL
    interval_s: float = 1.0  # between two scrapes
    window_s: float = 10.0  # rates and window percentiles cover this much of the past
    timeout_s: float = 5.0  # one scrape

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(
                f"URL {self.url!r} is not an http(s) URL; give the server's address, e.g. http://127.0.0.1:8000"
            )
        for name in ("interval_s", "window_s", "timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be more than 0")
        if self.window_s < self.interval_s:
            raise ValueError(
                f"window_s={self.window_s:g} is shorter than interval_s={self.interval_s:g}; a window "
                "needs two scrapes: raise --window or lower --interval"
            )


# -- formatting --------------------------------------------------------------------------------------
def fmt_count(value: float) -> str:
    return f"{value:,.0f}"


def fmt_rate(value: float | None, unit: str = "/s") -> str:
    if value is None:
        return "-"
    return f"{value:,.1f}{unit}" if value >= 10 or value == 0 else f"{value:.2f}{unit}"


def fmt_seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 0.01:
        return f"{value * 1000:.2f} ms"
    if value < 1:
        return f"{value * 1000:.1f} ms"
    return f"{value:.3f} s"


def fmt_bytes(value: float) -> str:
    return f"{value / 1e6:,.0f} MB" if value < 1e10 else f"{value / 1e9:,.2f} GB"


# -- what is shown ---------------------------------------------------------------------------------
def header(snap: Snapshot, url: str) -> str:
    models = sorted(
        {
            f"{labels['model']} (plan {labels['plan']}, {labels['device']})"
            for labels, _ in snap.series("accelab_model_info")
        }
    )
    ready, servers = snap.total("accelab_ready"), len(snap.series("accelab_ready"))
    state = "ready" if servers and ready == servers else f"{ready:.0f} of {servers} ready"
    return f"accelab top · {url} · {', '.join(models) or 'model loading'} · {state}"


def generates(snap: Snapshot) -> bool:
    """A generation server: it has a KV cache (continuous batching) or generated a token already.
    Encoders and classifiers export the generation series too, never moving: their rows are left out."""
    return snap.has("accelab_kv_cache_blocks") or snap.total("accelab_time_to_first_token_seconds_count") > 0


def traffic_rows(window: Window | None, snap: Snapshot) -> list[tuple[str, str, str]]:
    """(what, in the window, since start) for the traffic table."""
    rows = []
    generation = generates(snap)
    requests = api_requests(snap)

    def per_s(increase: float | None) -> float | None:  # over the window; None without one
        return increase / window.seconds if window and increase is not None else None

    w_requests = window.increase("accelab_requests_total", exclude={"route": NOT_API}) if window else None
    rows.append(("requests", fmt_rate(per_s(w_requests)), fmt_count(requests)))
    errors = snap.total("accelab_errors_total")
    w_errors = window.increase("accelab_errors_total") if window else None
    share = f" ({w_errors / w_requests:.1%})" if w_errors is not None and w_requests else ""
    kinds = ", ".join(f"{k} {v:,.0f}" for k, v in top_kinds(snap.by("accelab_errors_total", "kind")))
    rows.append(
        (
            "errors",
            fmt_rate(per_s(w_errors)) + share,
            fmt_count(errors) + (f" ({kinds})" if kinds else ""),
        )
    )
    for label, name, exclude, generation_only in LATENCIES:
        if not snap.has(f"{name}_bucket") or (generation_only and not generation):
            continue
        kw = {"exclude": exclude} if exclude else {}
        windowed = [window.quantile(q, name, **kw) if window else None for q in (0.5, 0.99)]
        started = [quantile_since_start(snap, q, name, **kw) for q in (0.5, 0.99)]
        rows.append(
            (f"{label} p50 · p99", " · ".join(map(fmt_seconds, windowed)), " · ".join(map(fmt_seconds, started)))
        )
    generated, prompt = snap.total("accelab_generated_tokens_total"), snap.total("accelab_prompt_tokens_total")
    if generation:
        w_gen = window.rate("accelab_generated_tokens_total") if window else None
        rows.append(("tokens generated", fmt_rate(w_gen), f"{fmt_count(generated)} (prompt {fmt_count(prompt)})"))
    else:
        w_prompt = window.rate("accelab_prompt_tokens_total") if window else None
        rows.append(("tokens in", fmt_rate(w_prompt), fmt_count(prompt)))
    retries = {cause: snap.total(name) for cause, name in RETRIES}
    w_retries = sum(window.increase(name) for _, name in RETRIES) / window.seconds if window else None
    causes = ", ".join(f"{k} {v:,.0f}" for k, v in top_kinds(retries, 3))
    rows.append(("retries", fmt_rate(w_retries), fmt_count(sum(retries.values())) + (f" ({causes})" if causes else "")))
    return rows


def quantile_since_start(snap: Snapshot, q: float, name: str, **kw) -> float | None:
    return quantile(q, snap.buckets(name, **kw))


def state_rows(snap: Snapshot) -> list[tuple[str, str]]:
    """(what, now) for the state table."""
    rows = [
        ("queue", f"{snap.total('accelab_queue_depth'):,.0f} waiting of {snap.total('accelab_queue_limit'):,.0f}"),
        ("in flight", f"{snap.total('accelab_requests_in_flight'):,.0f} requests"),
    ]
    if snap.has("accelab_kv_cache_blocks"):
        used, free = (
            snap.total("accelab_kv_cache_blocks", state="used"),
            snap.total("accelab_kv_cache_blocks", state="free"),
        )
        share = f" ({used / (used + free):.0%})" if used + free else ""
        rows.append(
            (
                "running",
                f"{snap.total('accelab_running_sequences'):,.0f} sequences, "
                f"{snap.total('accelab_waiting_sequences'):,.0f} waiting",
            )
        )
        rows.append(("KV cache", f"{used:,.0f} of {used + free:,.0f} blocks used{share}"))
    if generates(snap):
        rows.append(("tokens/s (server, 10 s)", fmt_rate(snap.total("accelab_generation_tokens_per_second"), "")))
    rows.append(("batch limit", f"{snap.total('accelab_batch_size_limit'):,.0f} inputs"))
    rows.append(("memory", f"{fmt_bytes(snap.total('accelab_process_resident_memory_bytes'))} resident"))
    for device, allocated in sorted(snap.by("accelab_gpu_memory_allocated_bytes", "device").items()):
        reserved = snap.total("accelab_gpu_memory_reserved_bytes", device=device)
        rows.append((f"GPU {device}", f"{fmt_bytes(allocated)} allocated, {fmt_bytes(reserved)} reserved"))
    if snap.has("accelab_replica_info") or snap.has("accelab_replicas_configured"):
        configured = snap.total("accelab_replicas_configured")
        rows.append(
            (
                "replicas",
                f"{snap.total('accelab_ready'):,.0f} ready of {configured:,.0f}, "
                f"{len(snap.series('accelab_replica_info'))} reporting",
            )
        )
    return rows


def render(snaps: deque[Snapshot], options: TopOptions, error: str | None = None):
    new = snaps[-1]
    window = Window(old=snaps[0], new=new) if len(snaps) > 1 else None
    span = f"last {window.seconds:.0f} s" if window else "last window (one more scrape)"
    traffic = Table(title=None, expand=False, show_edge=False)
    for column in ("traffic", span, "since start"):
        traffic.add_column(column, justify="left" if column == "traffic" else "right")
    for row in traffic_rows(window, new):
        traffic.add_row(*row)
    state = Table(show_edge=False)
    state.add_column("now")
    state.add_column("", justify="right")
    for now_row in state_rows(new):
        state.add_row(*now_row)
    footer = f"every {options.interval_s:g} s · {time.strftime('%H:%M:%S')} · Ctrl+C quits"
    parts: list[RenderableType] = [
        Text(header(new, options.url), style="bold"),
        traffic,
        state,
        Text(footer, style="dim"),
    ]
    if error:
        parts.insert(1, Text(error, style="bold red"))
    return Group(*parts)


# -- the loop ----------------------------------------------------------------------------------------
def run_top(
    options: TopOptions,
    *,
    fetch: Callable[[str], str] | None = None,
    clock: Callable[[], float] = time.monotonic,
    frames: int | None = None,
) -> int:
    """Redraw until Ctrl+C (or `frames` redraws); returns the exit status."""
    fetch = fetch or _http_fetch(options)
    console = Console()
    snaps: deque[Snapshot] = deque()
    first = _scrape(fetch, options, clock)  # a wrong URL fails here, before the screen is taken over
    if isinstance(first, str):
        Console(stderr=True).print(
            f"{first}; is `accelab serve` running there?", style="red", markup=False, soft_wrap=True
        )
        return 1
    snaps.append(first)
    drawn = 0
    with Live(render(snaps, options), console=console, screen=False, auto_refresh=False) as live:
        try:
            while frames is None or drawn < frames:
                time.sleep(options.interval_s)
                got = _scrape(fetch, options, clock)
                if not isinstance(got, str):
                    snaps.append(got)
                    while len(snaps) > 2 and snaps[-1].at - snaps[1].at >= options.window_s:
                        snaps.popleft()
                error = f"{got} (retrying every {options.interval_s:g} s)" if isinstance(got, str) else None
                live.update(render(snaps, options, error), refresh=True)
                drawn += 1
        except KeyboardInterrupt:
            pass
    return 0


def _scrape(fetch: Callable[[str], str], options: TopOptions, clock: Callable[[], float]) -> Snapshot | str:
    """A snapshot, or what went wrong (said on screen; the view keeps its last numbers)."""
    url = options.url.rstrip("/") + "/metrics"
    try:
        return Snapshot.parse(fetch(url), at=clock())
    except Exception as err:  # noqa: BLE001 - a server that went away is shown, not raised
        return f"cannot read {url}: {type(err).__name__}: {err}"


def _http_fetch(options: TopOptions) -> Callable[[str], str]:
    import httpx

    def fetch(url: str) -> str:
        response = httpx.get(url, timeout=options.timeout_s)
        response.raise_for_status()
        return response.text

    return fetch
