"""`accelab loadtest URL`: open- or closed-loop load against an OpenAI-compatible server;
latency percentiles, throughput, goodput under SLOs, and the highest rate that meets them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer


def register(app: typer.Typer) -> None:
    app.command("loadtest")(loadtest_command)


def loadtest_command(
    url: str = typer.Argument(..., help="Server base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)."),
    endpoint: str = typer.Option("chat", help="chat | completions | embeddings."),
    model: Optional[str] = typer.Option(None, help="Model id to send (default: the first of /v1/models)."),
    rate: Optional[float] = typer.Option(None, help="Open loop: requests per second (the start rate of "
                                         "--find-max)."),
    concurrency: Optional[int] = typer.Option(None, help="Closed loop: users, each sending its next request "
                                              "when the last one answered."),
    burstiness: float = typer.Option(1.0, help="Open-loop arrivals: gamma shape; 1 = Poisson, <1 burstier."),
    duration: float = typer.Option(30.0, help="Seconds of sending per run (each find-max probe is one run)."),
    requests: Optional[int] = typer.Option(None, help="Most requests per run (with --duration, whichever first)."),
    warmup: int = typer.Option(2, help="Requests sent first and left out of the numbers."),
    max_tokens: str = typer.Option("32", "--max-tokens", help="max_tokens of each generation request; a list "
                                   "(16,128,32,96) mixes short and long answers, request i asking for item i mod n."),
    stream: bool = typer.Option(True, "--stream/--no-stream", help="Stream generations (needed for TTFT/ITL)."),
    timeout: float = typer.Option(60.0, help="Seconds before one request counts as failed."),
    slo: Optional[str] = typer.Option(None, help="Per-request objectives, e.g. ttft=500ms,e2e=2s (keys: ttft, "
                                      "tpot, e2e); goodput counts requests meeting all."),
    find_max_: bool = typer.Option(False, "--find-max", help="Search the highest rate whose goodput meets "
                                   "--goodput-target (doubling, then bisection)."),
    goodput_target: float = typer.Option(0.95, "--goodput-target", help="Fraction of requests that must meet "
                                         "the SLO for a rate to pass."),
    max_steps: int = typer.Option(8, "--max-steps", help="Most runs a --find-max search makes."),
    cooldown: float = typer.Option(2.0, help="Seconds of quiet between --find-max runs (the server sheds a "
                                   "backlog)."),
    max_in_flight: int = typer.Option(1024, "--max-in-flight", help="Open loop: an arrival finding this many "
                                      "requests unanswered fails at once instead of opening another connection."),
    prompts_file: Optional[Path] = typer.Option(None, "--prompts-file", help="Inputs to send: a JSON list of "
                                                "strings or one per line (default: accelab's sample prompts / "
                                                "sentences)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="ACCELAB_API_KEY", show_envvar=True),
    seed: int = typer.Option(0, help="Seed of the arrival schedule."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the Result as JSON to this file."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="PNG: latency CDF (one run) or latency and goodput "
                                        "against offered load (--find-max)."),
    db: Optional[Path] = typer.Option(None, help="Results store (SQLite); default in the cache dir."),
    tag: Optional[str] = typer.Option(None, help="Label this run."),
    store: bool = typer.Option(True, "--store/--no-store", help="Append the run to the results store."),
) -> None:
    """Load-test a server: TTFT, TPOT, ITL and end-to-end percentiles, throughput, goodput."""
    from accelab.loadtest.client import LoadConfig, discover_model, parse_max_tokens, run_load
    from accelab.loadtest.run import build_result, search_max_rate
    from accelab.loadtest.summary import parse_slo, summarize_run
    from accelab.results.table import make_console

    console = make_console()
    objectives = parse_slo(slo)
    if find_max_ and not objectives.to_dict():
        raise ValueError("--find-max needs an --slo to meet, e.g. --slo ttft=500ms,e2e=2s")
    if find_max_ and concurrency is not None:
        raise ValueError("--find-max searches an open-loop --rate; drop --concurrency")
    if rate is None and concurrency is None:
        rate, concurrency = (1.0, None) if find_max_ else (None, 1)
    config = LoadConfig(
        url=url, endpoint=endpoint, inputs=tuple(_inputs(endpoint, prompts_file)), model=model, rate=rate,
        concurrency=concurrency, burstiness=burstiness, duration_s=duration, requests=requests, warmup=warmup,
        max_tokens=parse_max_tokens(max_tokens), stream=stream, timeout_s=timeout, api_key=api_key, seed=seed,
        max_in_flight=max_in_flight,
    )
    served = discover_model(config)
    if find_max_:
        def show(rate_: float, summary: dict[str, Any]) -> None:
            console.print(f"  {rate_:8.3g} req/s: goodput {summary['goodput_fraction']:.1%}, "
                          f"{summary['request_throughput']:.3g} req/s served, e2e p99 {_p(summary, 'e2e_ms')} ms, "
                          f"errors {summary['errors_by_status'] or 0}")

        console.print(f"find-max on {config.base_url} ({served}, {endpoint}), SLO {objectives.describe()}, "
                      f"goodput >= {goodput_target:.0%}:")
        search = search_max_rate(config, served, objectives, goodput_target=goodput_target, max_steps=max_steps,
                                 cooldown_s=cooldown, on_probe=show)
        result = build_result(config, served, objectives, search=search, goodput_target=goodput_target, tag=tag)
        best = "none (not even the lowest rate tried)" if search.best_rate is None else f"{search.best_rate:.4g} req/s"
        console.print(f"max sustainable rate: [bold]{best}[/bold]" + ("" if search.saturated else
                                                                       " (never saturated: raise --max-steps)"))
        if plot:
            from accelab.loadtest.plot import plot_find_max

            plot_find_max(result.metrics["probes"], plot, best_rate=search.best_rate,
                          title=f"{served} {endpoint}: latency and goodput vs load")
    else:
        records = run_load(config, served)
        summary = summarize_run(records, objectives, offered_rate=config.rate)
        result = build_result(config, served, objectives, summary=summary, tag=tag)
        _print_summary(console, summary)
        if plot:
            from accelab.loadtest.plot import plot_cdf

            ok = [r for r in records if r.ok]
            plot_cdf({"e2e": [r.e2e * 1000 for r in ok], "TTFT": [r.ttft * 1000 for r in ok if r.ttft is not None]},
                     plot, title=f"{served} {endpoint}: latency CDF")
    from accelab.results.store import keep

    keep(result, json_out=json_out, store=store, db=db)


def _inputs(endpoint: str, path: Path | None) -> list[str]:
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


def _p(summary: dict[str, Any], key: str, q: str = "p99") -> str:
    stats = summary.get(key)
    return f"{stats[q]:.4g}" if stats else "-"


def _print_summary(console: Any, s: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title="load test", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("requests (ok / errors)", f"{s['ok']} / {s['errors']}  {s['errors_by_status'] or ''}")
    table.add_row("duration", f"{s['duration_s']:.2f} s")
    table.add_row("request throughput", f"{s['request_throughput']:.3f} req/s")
    table.add_row("output token throughput", f"{s['output_token_throughput']:.1f} tok/s")
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "end-to-end")):
        if s.get(key):
            table.add_row(f"{label} p50 / p90 / p99", " / ".join(f"{s[key][q]:.4g}" for q in ("p50", "p90", "p99"))
                          + " ms")
    if s["slo"]:
        table.add_row("goodput", f"{s['goodput_fraction']:.1%} of requests, {s['goodput_rate']:.3f} req/s")
    console.print(table)
