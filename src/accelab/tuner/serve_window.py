"""One window of a serving tune: the closed-loop streaming chat load a candidate server is measured
under (after a warm-up that pays its one-time costs), the figures it yields (output tokens/s,
TTFT and ITL, goodput under the SLO, the machine's noise around it), the Result each window is
stored as, and the line printed for it."""

from __future__ import annotations

import os
from typing import Any

from accelab.catalog import inputs
from accelab.loadtest.client import LoadConfig, run_load
from accelab.loadtest.summary import summarize_run
from accelab.measure.noise import Meter
from accelab.results import contract as K
from accelab.results.result import Result
from accelab.tuner.serve_candidates import CandidateServer
from accelab.tuner.serve_rank import Candidate
from accelab.tuner.serve_request import ServeTuneRequest


def measure_window(server: CandidateServer, request: ServeTuneRequest, users: int) -> dict[str, Any]:
    """One closed-loop window of streaming chat from `users` users (a warm-up request each first)."""
    config = LoadConfig(
        url=server.url,
        endpoint="chat",
        inputs=request.prompts or _sample_prompts(),
        model=server.served_name,
        concurrency=users,
        duration_s=request.window_s,
        warmup=users,
        max_tokens=request.max_tokens,
        stream=True,
        timeout_s=600,
    )
    with Meter([*server.pids(), os.getpid()]) as meter:  # the server's processes and this client are not noise
        records = run_load(config, server.served_name)
    summary = summarize_run(records, request.slo)
    good_tokens = sum(r.output_tokens for r in records if request.slo.met_by(r))
    row = dict(summary)
    row[K.GOODPUT_TOKEN_THROUGHPUT] = good_tokens / summary[K.DURATION_S]
    row[K.NOISE] = meter.window.to_dict() if meter.window else None
    return row


def warm_up(server: CandidateServer, request: ServeTuneRequest) -> None:
    """Every prompt once, short answers, from the most users the tune runs: the shapes a server
    meets first (each prompt length's prefill, each batch of decodes) cost it one-time work
    (kernels chosen, memory mapped) that no window should pay: measured on SmolLM2, a first
    1-user window without this ran torch fp32 at half its speed of the next round."""
    prompts = request.prompts or _sample_prompts()
    config = LoadConfig(
        url=server.url,
        endpoint="chat",
        inputs=prompts,
        model=server.served_name,
        concurrency=max(request.concurrency),
        duration_s=300,
        requests=len(prompts),
        warmup=0,
        max_tokens=8,
        stream=True,
        timeout_s=600,
    )
    run_load(config, server.served_name)


def _sample_prompts() -> tuple[str, ...]:
    return tuple(inputs.prompts(52))


def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _p99(row: dict[str, Any], name: str) -> float | None:
    return (row.get(name) or {}).get("p99")


def window_result(
    candidate: Candidate, request: ServeTuneRequest, group: str, users: int, rnd: int, row: dict
) -> Result:
    metrics = {
        **row,
        K.TUNE_CANDIDATE: candidate.key,
        K.TUNE_ROUND: rnd,
        K.PEAK_RSS_MB: candidate.peak_rss_mb,
    }
    return Result(
        kind="tune-serve",
        status="ok",
        model=request.spec.to_dict(),
        plan=candidate.plan.to_dict(),
        workload={
            "scenario": "serve",
            "endpoint": "chat",
            "concurrency": users,
            "duration_s": request.window_s,
            "max_tokens": list(request.max_tokens),
            "slo": request.slo.to_dict(),
            "server": request.settings,
        },
        metrics=metrics,
        group_id=group,
    )


def excluded_result(candidate: Candidate, request: ServeTuneRequest, group: str) -> Result:
    """A candidate that will not be measured (it failed to start, or its memory is over the
    limit), kept so that a resumed tune does not start it again."""
    return Result(
        kind="tune-serve",
        status="error",
        reason=candidate.excluded,
        model=request.spec.to_dict(),
        plan=candidate.plan.to_dict(),
        workload={"scenario": "serve", "server": request.settings},
        metrics={K.TUNE_CANDIDATE: candidate.key, K.PEAK_RSS_MB: candidate.peak_rss_mb},
        group_id=group,
    )


def window_line(candidate: Candidate, users: int, rnd: int, row: dict[str, Any]) -> str:
    steal = (row.get(K.NOISE) or {}).get("steal")
    return (
        f"  round {rnd + 1} {users:>3} users  {candidate.key:<32} {row[K.OUTPUT_TOKEN_THROUGHPUT]:8.1f} tok/s  "
        f"goodput {row[K.GOODPUT_TOKEN_THROUGHPUT]:8.1f}  TTFT p99 {_fmt(_p99(row, K.TTFT_MS))} ms  "
        f"ITL p99 {_fmt(_p99(row, K.ITL_MS), 1)} ms  errors {row[K.ERRORS]}  "
        f"steal {'-' if steal is None else f'{100 * steal:.1f}%'}"
    )
