"""`accelab tune MODEL --scenario serve`: the serving plan with the most goodput under the user's
own load, SLO, memory limit and quality tolerance.

Every candidate plan (the torch step engine at each precision it supports, llama.cpp's
quantisations, vLLM where installed; `--include` names others) is an `accelab serve` process
with the same server settings, all up at once. The same closed-loop streaming chat load runs
on each in turn, round after round (A B C ... C B A), with the machine's CPU steal recorded
around each window, so a noisy minute hits every candidate alike. Per candidate and load level:
output tokens/s, TTFT and ITL p99, goodput (output tokens/s of the requests that met every
objective of the SLO), the peak memory of its processes, and `accelab verify`'s verdict on its
plan. The winner has the highest median goodput of the candidates within the memory limit whose
quality passes; every other one is listed with why it lost. Each window is a Result in the store
(kind tune-serve, the tune's id as its group), so an interrupted tune resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import statistics
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from accelab.catalog import inputs
from accelab.catalog.spec import ModelSpec
from accelab.loadtest.client import LoadConfig, run_load
from accelab.loadtest.summary import SLO, summarize_run
from accelab.measure import noise
from accelab.measure.noise import Meter
from accelab.plan.apply import resolve_device
from accelab.plan.plan import Plan, load_plan
from accelab.plan.runtime import Unsupported
from accelab.quality.collect import QualityConfig
from accelab.quality.verdict import LEVELS
from accelab.quality.verify import verify
from accelab.results import contract as K
from accelab.results.result import Result
from accelab.results.store import Store, open_store
from accelab.results.table import make_console
from accelab.runtimes import check_supported
from accelab.tuner.serve_candidates import CandidateServer, MemoryWatch, wait_all_ready
from accelab.tuner.space import slow_here, techniques
from accelab.units import parse_objectives, parse_size_mib

# the default candidates: torch at each precision, llama.cpp at its default and at Q8_0 (batched
# x86 kernels), vLLM in bf16 compiled (its own defaults), OpenVINO GenAI with int8 weights at bf16
SERVE_CANDIDATES = (
    "baseline",
    "bf16",
    "int8-bf16",
    "llamacpp",
    "llamacpp[llama_quant=q8_0]",
    "vllm-bf16[vllm_mode=compiled]",
    "openvino-int8-bf16",
)
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
    try:
        levels = tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise ValueError(f"--concurrency {text!r} must be whole numbers, comma-separated (e.g. 1,8,16)") from None
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency {text!r} must be 1 or more users (e.g. 8, or 1,8,16)")
    return tuple(sorted(set(levels)))


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


@dataclass(kw_only=True, slots=True)
class Candidate:
    key: str
    plan: Plan
    server: CandidateServer | None = None
    quality: str | None = None  # pass | warn | fail | None (not checked)
    quality_detail: str = ""
    windows: dict[int, dict[int, dict[str, Any]]] = field(default_factory=dict)  # users -> round -> its row
    excluded: str | None = None  # why it cannot win, whatever it measured
    stored_peak_mb: float = 0.0  # the peak memory its windows in the store recorded (a resumed tune)

    @property
    def peak_rss_mb(self) -> float | None:
        peak = max(self.stored_peak_mb, self.server.peak_rss_mb if self.server else 0.0)
        return peak or None

    def rows(self, users: int) -> list[dict[str, Any]]:
        return [row for _, row in sorted(self.windows.get(users, {}).items())]

    def median(self, users: int, name: str) -> float | None:
        values = [w[name] for w in self.rows(users) if w.get(name) is not None]
        return statistics.median(values) if values else None


@dataclass(kw_only=True, slots=True)
class LevelRanking:
    users: int
    winner: str | None
    order: list[str]  # best first, the excluded last
    why: dict[str, str]  # candidate -> why it lost
    tie_with: str | None = None


@dataclass(kw_only=True, slots=True)
class ServeTuneOutcome:
    group: str
    candidates: dict[str, Candidate]
    pruned: dict[str, str]
    rankings: list[LevelRanking]
    plan: Plan | None = None
    reused: int = 0


# -- the space -------------------------------------------------------------------------------------
def serve_space(request: ServeTuneRequest) -> tuple[list[Candidate], dict[str, str]]:
    """The candidate plans that can serve this model here, and why the others are left out."""
    device = resolve_device(Plan(), request.device)
    keys = list(request.include) if request.include else list(SERVE_CANDIDATES)
    if "baseline" not in keys:
        keys.insert(0, "baseline")
    slow = slow_here(device) if not request.include and not request.max_memory else {}
    chosen, pruned = [], {}
    for key in keys:
        if key in request.exclude:
            pruned[key] = "excluded with --exclude"
            continue
        plan = load_plan(key)
        try:
            check_supported(plan, request.spec, device)
        except Unsupported as why:
            pruned[key] = str(why)
            continue
        if key != "baseline" and (reason := next((slow[t] for t in techniques(plan) if t in slow), None)):
            pruned[key] = f"{reason} (name it in --include to measure it anyway)"
            continue
        chosen.append(Candidate(key=key, plan=plan))
    return chosen, pruned


def tune_id(request: ServeTuneRequest, keys: list[str]) -> str:
    """Same model, candidates, load, SLO, limits and settings -> same id: a rerun resumes."""
    blob = json.dumps(
        [
            request.spec.to_dict(),
            keys,
            request.concurrency,
            asdict(request.slo),
            request.max_memory,
            request.quality,
            request.prompts,
            request.max_tokens,
            request.rounds,
            request.window_s,
            request.settings,
        ],
        sort_keys=True,
        default=str,
    )
    return "tune-serve-" + hashlib.sha256(blob.encode()).hexdigest()[:12]


# -- measuring -------------------------------------------------------------------------------------
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


def check_quality(candidate: Candidate, request: ServeTuneRequest, store: Store | None, group: str) -> None:
    """verify's verdict on the candidate's plan (fp32 eager as the reference), from the store
    when this tune checked it before."""
    if request.quality == "off":
        return
    if candidate.key == "baseline":
        candidate.quality, candidate.quality_detail = "pass", "the fp32 reference itself"
        return
    tag = f"{group}:{candidate.key}"
    earlier = [r for r in store.query(group_id=group, kind="verify", tag=tag)] if store is not None else []
    if earlier and earlier[0].quality is not None:
        result = earlier[0]
    else:
        config = QualityConfig(samples=8, new_tokens=16, batch_size=8)
        result = verify(request.spec, candidate.plan, config, tolerance=request.quality, device=request.device)
        result.tag, result.group_id = tag, group
        if store is not None:
            store.add(result)
    if result.quality is None:
        candidate.quality, candidate.quality_detail = "fail", f"verify could not run it: {result.reason}"
        return
    candidate.quality = result.quality["verdict"]
    candidate.quality_detail = "; ".join(result.quality.get("rules", []))


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


def run_serve_tune(request: ServeTuneRequest, console: Console | None = None) -> ServeTuneOutcome:
    console = console or make_console()
    candidates, pruned = serve_space(request)
    group = tune_id(request, [c.key for c in candidates])
    store = open_store(request.db)
    done: dict[tuple[str, int, int], dict[str, Any]] = {}
    if not request.fresh:
        for r in store.query(group_id=group, kind="tune-serve"):
            if not r.ok:  # a candidate that failed to start or went over the memory limit
                excluded = next((c for c in candidates if c.key == r.metrics[K.TUNE_CANDIDATE]), None)
                if excluded is not None and excluded.excluded is None:
                    excluded.excluded = f"{r.reason} (this tune, earlier: --fresh measures it again)"
                    excluded.stored_peak_mb = r.metrics.get(K.PEAK_RSS_MB) or 0.0
                continue
            where = (r.metrics[K.TUNE_CANDIDATE], r.workload["concurrency"], r.metrics[K.TUNE_ROUND])
            done.setdefault(where, r.metrics)
        if done:
            console.print(f"resuming tune {group}: {len(done)} windows measured before are reused")
    wanted = [(users, rnd) for users in request.concurrency for rnd in range(request.rounds)]
    console.print(
        f"tuning {request.spec.name} for serving: {len(candidates)} candidate servers, "
        f"{','.join(map(str, request.concurrency))} users, {request.rounds} rounds of {request.window_s:g} s, "
        f"SLO {request.slo.describe()}, memory {request.max_memory or '-'}, quality {request.quality}; "
        f"server settings {request.settings}"
    )
    noise.warn_if_busy(lambda text: console.print(f"[yellow]warning: {escape(text)}[/]"))
    limit_mb = parse_size_mib(request.max_memory) if request.max_memory else None
    for candidate in candidates:
        if candidate.excluded:
            continue
        check_quality(candidate, request, store, group)
        if candidate.quality == "fail" or (candidate.quality == "warn" and request.quality == "strict"):
            candidate.excluded = f"quality {candidate.quality} ({request.quality}): {candidate.quality_detail}"
    to_serve = [c for c in candidates if c.excluded is None and any((c.key, *w) not in done for w in wanted)]
    for candidate in candidates:  # what the store holds already
        for users, rnd in wanted:
            if (row := done.get((candidate.key, users, rnd))) is not None:
                candidate.windows.setdefault(users, {})[rnd] = row
                candidate.stored_peak_mb = max(candidate.stored_peak_mb, row.get(K.PEAK_RSS_MB) or 0.0)
    with tempfile.TemporaryDirectory(prefix="accelab-tune-serve-") as logs:
        for candidate in to_serve:
            candidate.server = _server_for(candidate, request)
        servers = [c.server for c in to_serve if c.server is not None]
        try:
            with MemoryWatch(servers) as watch:
                for server in servers:
                    console.print(f"starting {escape(server.key)}: accelab {escape(shlex.join(server.command()[3:]))}")
                    server.start(Path(logs))
                wait_all_ready(servers, request.ready_timeout_s)
                watch.sample()
                for candidate in to_serve:
                    assert candidate.server is not None
                    if candidate.server.error:
                        candidate.excluded = f"failed to start: {candidate.server.error}"
                    elif limit_mb is not None and (candidate.peak_rss_mb or 0.0) > limit_mb:
                        candidate.excluded = _over_memory(candidate.peak_rss_mb or 0.0, limit_mb, request)
                    if candidate.excluded:
                        candidate.server.stop()
                        store.add(excluded_result(candidate, request, group))
                live = [c for c in to_serve if c.excluded is None]
                for candidate in live:
                    assert candidate.server is not None
                    console.print(f"warming up {escape(candidate.key)}: every prompt once")
                    try:
                        warm_up(candidate.server, request)
                    except Exception as err:  # noqa: BLE001 - this candidate fails alone
                        candidate.excluded = f"failed while warming up: {type(err).__name__}: {err}"
                        candidate.server.stop()
                        store.add(excluded_result(candidate, request, group))
                live = [c for c in live if c.excluded is None]
                seq = len(done)
                for users in request.concurrency:
                    for rnd in range(request.rounds):
                        order = live if rnd % 2 == 0 else list(reversed(live))
                        for candidate in order:
                            if (candidate.key, users, rnd) in done or candidate.excluded:
                                continue
                            assert candidate.server is not None
                            try:
                                row = measure_window(candidate.server, request, users)
                            except Exception as err:  # noqa: BLE001 - this candidate fails alone
                                candidate.excluded = f"failed under load: {type(err).__name__}: {err}"
                                candidate.server.stop()
                                continue
                            watch.sample()
                            row[K.TUNE_SEQ] = seq
                            seq += 1
                            candidate.windows.setdefault(users, {})[rnd] = row
                            store.add(window_result(candidate, request, group, users, rnd, row))
                            console.print(escape(_window_line(candidate, users, rnd, row)))
                            if not candidate.server.alive:
                                candidate.excluded = f"died under load: {candidate.server.log_tail()}"
        finally:
            for server in servers:
                server.stop()
    for candidate in candidates:
        if candidate.excluded is None and limit_mb is not None and (candidate.peak_rss_mb or 0.0) > limit_mb:
            candidate.excluded = _over_memory(candidate.peak_rss_mb or 0.0, limit_mb, request)
    rankings = [rank(candidates, users) for users in request.concurrency]
    top = rankings[-1]  # the plan file serves the largest load asked for
    plan = None
    if top.winner is not None:
        won = next(c for c in candidates if c.key == top.winner)
        plan = won.plan.with_changes(name=f"serve-tuned-{top.winner}", server=tuple(sorted(request.settings.items())))
    reused = sum(1 for c in candidates for users, rnd in wanted if (c.key, users, rnd) in done)
    return ServeTuneOutcome(
        group=group,
        candidates={c.key: c for c in candidates},
        pruned=pruned,
        rankings=rankings,
        plan=plan,
        reused=reused,
    )


def _server_for(candidate: Candidate, request: ServeTuneRequest) -> CandidateServer:
    return CandidateServer(
        key=candidate.key,
        model=request.model,
        served_name=request.spec.name,
        settings=request.settings,
        # every request is answered, however long the queue: the load, not a timeout, is measured
        extra_args=("--max-queue", "1024", "--request-timeout", "600", "--max-tokens", str(max(request.max_tokens))),
    )


def _over_memory(peak_mb: float, limit_mb: float, request: ServeTuneRequest) -> str:
    return (
        f"peak memory {peak_mb:.0f} MiB (its processes' RSS) over --max-memory {request.max_memory} "
        f"({limit_mb:.0f} MiB)"
    )


def _window_line(candidate: Candidate, users: int, rnd: int, row: dict[str, Any]) -> str:
    steal = (row.get(K.NOISE) or {}).get("steal")
    return (
        f"  round {rnd + 1} {users:>3} users  {candidate.key:<32} {row[K.OUTPUT_TOKEN_THROUGHPUT]:8.1f} tok/s  "
        f"goodput {row[K.GOODPUT_TOKEN_THROUGHPUT]:8.1f}  TTFT p99 {_fmt(_p99(row, K.TTFT_MS))} ms  "
        f"ITL p99 {_fmt(_p99(row, K.ITL_MS), 1)} ms  errors {row[K.ERRORS]}  "
        f"steal {'-' if steal is None else f'{100 * steal:.1f}%'}"
    )


# -- ranking ---------------------------------------------------------------------------------------
def rank(candidates: list[Candidate], users: int) -> LevelRanking:
    """Highest median goodput first among the eligible; a runner-up whose goodput paired round by
    round with the winner's (the same minute of the machine) comes within 3% is a tie."""
    why: dict[str, str] = {}
    eligible = []
    for c in candidates:
        if c.excluded:
            why[c.key] = c.excluded
        elif not c.windows.get(users):
            why[c.key] = "not measured at this load"
        else:
            eligible.append(c)
    eligible.sort(key=lambda c: c.median(users, K.GOODPUT_TOKEN_THROUGHPUT) or 0.0, reverse=True)
    if not eligible or not eligible[0].median(users, K.GOODPUT_TOKEN_THROUGHPUT):
        for c in eligible:
            why[c.key] = "no request met the SLO"
        order = [c.key for c in eligible] + [k for k in why if k not in {c.key for c in eligible}]
        return LevelRanking(users=users, winner=None, order=order, why=why)
    best = eligible[0]
    top = best.median(users, K.GOODPUT_TOKEN_THROUGHPUT) or 0.0
    tie_with = None
    for c in eligible[1:]:
        ratios = paired_ratios(c, best, users)
        mine = c.median(users, K.GOODPUT_TOKEN_THROUGHPUT) or 0.0
        words = f"goodput {mine:.1f} tokens/s, {mine / top:.2f}x the winner's {top:.1f}"
        if ratios:
            words += f" (paired rounds {', '.join(f'{r:.2f}' for r in ratios)})"
        if ratios and abs(statistics.median(ratios) - 1) <= 0.03 and tie_with is None:
            tie_with = c.key
            words += ": a tie within the noise of this machine"
        why[c.key] = words
    order = [c.key for c in eligible] + [k for k in why if k not in {c.key for c in eligible}]
    return LevelRanking(users=users, winner=best.key, order=order, why=why, tie_with=tie_with)


def paired_ratios(a: Candidate, b: Candidate, users: int) -> list[float]:
    """a's goodput over b's, round by round (the same minute of the machine)."""
    mine, theirs = a.windows.get(users, {}), b.windows.get(users, {})
    ratios = []
    for rnd in sorted(set(mine) & set(theirs)):
        x, y = mine[rnd].get(K.GOODPUT_TOKEN_THROUGHPUT), theirs[rnd].get(K.GOODPUT_TOKEN_THROUGHPUT)
        if x and y:
            ratios.append(x / y)
    return ratios
