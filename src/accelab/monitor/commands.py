"""`accelab top URL`: a live terminal view of a running `accelab serve` (its /metrics)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    app.command("top")(top_command)


def top_command(
    url: str = typer.Argument(
        ...,
        help="The server's base URL, e.g. http://127.0.0.1:8000 (a --replicas server's "
        "front shows all its replicas together).",
    ),
    interval: float = typer.Option(1.0, "--interval", help="Seconds between two reads of /metrics."),
    window: float = typer.Option(10.0, "--window", help="Rates and the window's percentiles cover this many seconds."),
) -> None:
    """Watch a server live: requests/s, errors, latency and TTFT percentiles, tokens/s, queue, running
    sequences, KV cache, memory, replicas, retries (Ctrl+C quits)."""
    from accelab.monitor.top import TopOptions, run_top

    raise typer.Exit(run_top(TopOptions(url=url, interval_s=interval, window_s=window)))
