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
import shlex
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from accelab.measure import noise
from accelab.measure.capabilities import bf16_outruns_fp32
from accelab.plan import fit
from accelab.plan.apply import resolve_device
from accelab.plan.plan import Plan, load_plan
from accelab.plan.runtime import Unsupported
from accelab.quality.collect import config_for
from accelab.quality.verdict import label, tune_exclusion
from accelab.quality.verify import verify
from accelab.results import contract as K
from accelab.results.store import Store, open_store
from accelab.results.table import make_console
from accelab.runtimes import check_supported
from accelab.tuner.serve_candidates import CandidateServer, MemoryWatch, wait_all_ready
from accelab.tuner.serve_memory import fitting_groups, memory_excess
from accelab.tuner.serve_rank import Candidate, LevelRanking, rank
from accelab.tuner.serve_request import ServeTuneRequest, parse_levels, parse_serve_slo
from accelab.tuner.serve_window import excluded_result, measure_window, warm_up, window_line, window_result
from accelab.tuner.space import slow_here, techniques
from accelab.units import parse_size_mib

# `accelab tune`'s command imports the request's parsers from here, with the request
__all__ = ["ServeTuneOutcome", "ServeTuneRequest", "parse_levels", "parse_serve_slo", "run_serve_tune"]

Window = tuple[str, int, int]  # (candidate, users, round)

# the default candidates: every plan that wins on some kind of CPU. The own engine at float32 and
# bf16, eager and compiled, with int8 weights (bf16 activations: the AMX operator; float32 ones: the
# AVX2 operator), the output layer int8 too; llama.cpp at its default and at Q8_0; vLLM compiled
# (its defaults) in float32 and bf16; OpenVINO GenAI's int8 weights at float32 and bf16 inference.
# `serve_space` leaves out, with the reason, what `accelab env` measured slow on this CPU (bf16
# where it is emulated) and the float32 twins where bf16 is the faster precision.
SERVE_CANDIDATES = (
    "baseline",
    "compile",
    "bf16",
    "bf16[compile=default]",
    "int8-weight",
    "int8-weight[compile=default]",
    "int8-weight[compile=default;quantize_head=true]",
    "int8-bf16",
    "int8-bf16[compile=default]",
    "int8-bf16[compile=default;quantize_head=true]",
    "llamacpp",
    "llamacpp[llama_quant=q8_0]",
    "vllm[vllm_mode=compiled]",
    "vllm-bf16[vllm_mode=compiled]",
    "openvino-int8",
    "openvino-int8-bf16",
)


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
    judged = not request.include and not request.max_memory
    slow = slow_here(device) if judged else {}
    bf16_wins = bf16_outruns_fp32(device) if judged else None
    chosen, pruned = [], {}
    for key in keys:
        if key in request.exclude:
            pruned[key] = "excluded with --exclude"
            continue
        plan = load_plan(key)
        try:
            check_supported(plan, request.spec, device)
            fit.check(request.spec, plan, device)  # its server alone would not fit (an 8B in float32)
        except Unsupported as why:
            pruned[key] = str(why)
            continue
        if key != "baseline" and (reason := next((slow[t] for t in serve_techniques(plan) if t in slow), None)):
            pruned[key] = f"{reason} (name it in --include to measure it anyway)"
            continue
        if bf16_wins and _int8(plan) and not HALF & set(serve_techniques(plan)):
            pruned[key] = f"its bf16 twin serves int8 here: {bf16_wins} (name it in --include to measure it anyway)"
            continue
        chosen.append(Candidate(key=key, plan=plan))
    return chosen, pruned


def serve_techniques(plan: Plan) -> list[str]:
    """The capability report's names for what a serving plan changes (`techniques`), but a torch
    plan's int8 weights run the engine's own int8 operator (its probe), not torchao's eager kernel."""
    used = techniques(plan)
    if plan.backend == "torch" and plan.quantization == "int8-weight":
        operator = "int8-gemm-bf16" if plan.precision.startswith("bf16") else "int8-gemm-f32"
        used = [operator if t == "int8-weight" else t for t in used]
    return used


HALF = {"bf16-weights", "bf16-autocast", "fp16-weights", "fp16-autocast"}  # techniques of a 16-bit plan


def _int8(plan: Plan) -> bool:
    """Int8 weights: the own engine's, vLLM's (none here yet) or OpenVINO GenAI's."""
    return plan.quantization == "int8-weight" or plan.option.get("ov_weights") == "int8"


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
        # a tune's sample; no greedy continuations (reported, never judged: the verdict is all a tune needs)
        config = config_for(request.spec.task, tune=True, new_tokens=0, batch_size=8)
        result = verify(request.spec, candidate.plan, config, tolerance=request.quality, device=request.device)
        result.tag, result.group_id = tag, group
        if store is not None:
            store.add(result)
    if result.quality is None:
        candidate.quality, candidate.quality_detail = "fail", f"verify could not run it: {result.reason}"
        return
    candidate.quality = label(result.quality)
    candidate.quality_detail = "; ".join(result.quality.get("rules", []))


# -- the run ---------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class _Tune:
    """What every step of one tune run shares."""

    request: ServeTuneRequest
    store: Store
    group: str
    console: Console
    limit_mb: float | None  # --max-memory in MiB

    def drop(self, candidate: Candidate, why: str) -> None:
        """Exclude a started candidate for good: stop it, and store why (a resumed tune skips it)."""
        assert candidate.server is not None
        candidate.excluded = why
        candidate.server.stop()
        self.store.add(excluded_result(candidate, self.request, self.group))


def run_serve_tune(request: ServeTuneRequest, console: Console | None = None) -> ServeTuneOutcome:
    """The recipe: the space; what the store holds of this tune already; verify each candidate's
        plan; start the candidates still to measure, all at once (in groups where the memory holds
    fewer: `serve_memory`), and measure them round by round;
        rank them at each load level. The Plan file serves the largest load asked for."""
    console = console or make_console()
    candidates, pruned = serve_space(request)
    group = tune_id(request, [c.key for c in candidates])
    store = open_store(request.db)
    done = {} if request.fresh else _stored_windows(store, group, candidates)
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
    tune = _Tune(request=request, store=store, group=group, console=console, limit_mb=limit_mb)
    for candidate in candidates:
        if not candidate.excluded:
            _screen_quality(candidate, tune)
    to_serve = [c for c in candidates if c.excluded is None and any((c.key, *w) not in done for w in wanted)]
    _take_stored(candidates, done, wanted)
    for batch in _groups_that_fit(to_serve, tune):
        _serve_and_measure(batch, done, tune)
    for candidate in candidates:
        if candidate.excluded is None and (why := memory_excess(candidate, tune.limit_mb, tune.request.max_memory)):
            candidate.excluded = why
    rankings = [rank(candidates, users) for users in request.concurrency]
    return ServeTuneOutcome(
        group=group,
        candidates={c.key: c for c in candidates},
        pruned=pruned,
        rankings=rankings,
        plan=_winning_plan(candidates, rankings[-1], request),
        reused=sum(1 for c in candidates for users, rnd in wanted if (c.key, users, rnd) in done),
    )


def _stored_windows(store: Store, group: str, candidates: list[Candidate]) -> dict[Window, dict[str, Any]]:
    """The windows this tune measured before, by (candidate, users, round); a candidate stored as
    failed (it did not start, or went over the memory limit) is excluded again."""
    done: dict[Window, dict[str, Any]] = {}
    for r in store.query(group_id=group, kind="tune-serve"):
        if not r.ok:
            excluded = next((c for c in candidates if c.key == r.metrics[K.TUNE_CANDIDATE]), None)
            if excluded is not None and excluded.excluded is None:
                excluded.excluded = f"{r.reason} (this tune, earlier: --fresh measures it again)"
                excluded.stored_peak_mb = r.metrics.get(K.PEAK_RSS_MB) or 0.0
            continue
        where = (r.metrics[K.TUNE_CANDIDATE], r.workload["concurrency"], r.metrics[K.TUNE_ROUND])
        done.setdefault(where, r.metrics)
    return done


def _take_stored(
    candidates: list[Candidate], done: dict[Window, dict[str, Any]], wanted: list[tuple[int, int]]
) -> None:
    for candidate in candidates:
        for users, rnd in wanted:
            if (row := done.get((candidate.key, users, rnd))) is not None:
                candidate.windows.setdefault(users, {})[rnd] = row
                candidate.stored_peak_mb = max(candidate.stored_peak_mb, row.get(K.PEAK_RSS_MB) or 0.0)


def _screen_quality(candidate: Candidate, tune: _Tune) -> None:
    """Excluded when verify fails its plan or cannot rule a failure out (or a warning, under
    --quality strict): `quality.verdict.tune_exclusion`."""
    check_quality(candidate, tune.request, tune.store, tune.group)
    why = tune_exclusion(candidate.quality, tune.request.quality)
    if why is not None:
        candidate.excluded = f"{why}: {candidate.quality_detail}"


def _groups_that_fit(to_serve: list[Candidate], tune: _Tune) -> list[list[Candidate]]:
    """The candidates in groups the machine's memory holds at once (`serve_memory`); one left out
    is stored as excluded, with its figure."""
    batches, groups = fitting_groups(to_serve, tune.request.spec)
    for candidate in (c for c in to_serve if c.key in groups.left_out):
        candidate.excluded = groups.left_out[candidate.key]
        tune.store.add(excluded_result(candidate, tune.request, tune.group))
        tune.console.print(f"[yellow]{escape(candidate.key)} left out: {escape(candidate.excluded)}[/]")
    if len(batches) > 1:
        tune.console.print(f"memory: the candidates run in {len(batches)} groups, {escape(groups.describe())}")
    return batches


def _serve_and_measure(to_serve: list[Candidate], done: dict[Window, dict[str, Any]], tune: _Tune) -> None:
    """Start every candidate server at once; drop those that did not start, are over the memory
    limit or fail their warm-up; measure the rest round by round; stop them all, whatever happens."""
    with tempfile.TemporaryDirectory(prefix="accelab-tune-serve-") as logs:
        for candidate in to_serve:
            candidate.server = _server_for(candidate, tune.request)
        servers = [c.server for c in to_serve if c.server is not None]
        try:
            with MemoryWatch(servers) as watch:
                for server in servers:
                    tune.console.print(
                        f"starting {escape(server.key)}: accelab {escape(shlex.join(server.command()[3:]))}"
                    )
                    server.start(Path(logs))
                wait_all_ready(servers, tune.request.ready_timeout_s)
                watch.sample()
                live = [c for c in to_serve if _started(c, tune)]
                live = [c for c in live if _warmed_up(c, tune)]
                _measure_rounds(live, done, watch, tune)
        finally:
            for server in servers:
                server.stop()


def _started(candidate: Candidate, tune: _Tune) -> bool:
    """Up and within the memory limit; else dropped."""
    assert candidate.server is not None
    over = memory_excess(candidate, tune.limit_mb, tune.request.max_memory)
    why = f"failed to start: {candidate.server.error}" if candidate.server.error else over
    if why:
        tune.drop(candidate, why)
    return candidate.excluded is None


def _warmed_up(candidate: Candidate, tune: _Tune) -> bool:
    assert candidate.server is not None
    tune.console.print(f"warming up {escape(candidate.key)}: every prompt once")
    try:
        warm_up(candidate.server, tune.request)
    except Exception as err:  # noqa: BLE001 - this candidate fails alone
        tune.drop(candidate, f"failed while warming up: {type(err).__name__}: {err}")
    return candidate.excluded is None


def _measure_rounds(live: list[Candidate], done: dict[Window, dict[str, Any]], watch: MemoryWatch, tune: _Tune) -> None:
    """Each load level, round after round, the candidates in turn A B C ... C B A, so a noisy
    minute of the machine hits every candidate alike; windows the store holds are skipped."""
    seq = len(done)
    for users in tune.request.concurrency:
        for rnd in range(tune.request.rounds):
            order = live if rnd % 2 == 0 else list(reversed(live))
            for candidate in order:
                if (candidate.key, users, rnd) in done or candidate.excluded:
                    continue
                if _measure_one(candidate, users, rnd, seq, watch, tune):
                    seq += 1


def _measure_one(candidate: Candidate, users: int, rnd: int, seq: int, watch: MemoryWatch, tune: _Tune) -> bool:
    """One window, stored and printed; False when the candidate failed under it (it stops then)."""
    assert candidate.server is not None
    try:
        row = measure_window(candidate.server, tune.request, users)
    except Exception as err:  # noqa: BLE001 - this candidate fails alone
        candidate.excluded = f"failed under load: {type(err).__name__}: {err}"
        candidate.server.stop()
        return False
    watch.sample()
    row[K.TUNE_SEQ] = seq
    candidate.windows.setdefault(users, {})[rnd] = row
    tune.store.add(window_result(candidate, tune.request, tune.group, users, rnd, row))
    tune.console.print(escape(window_line(candidate, users, rnd, row)))
    if not candidate.server.alive:
        candidate.excluded = f"died under load: {candidate.server.log_tail()}"
    return True


def _winning_plan(candidates: list[Candidate], top: LevelRanking, request: ServeTuneRequest) -> Plan | None:
    """The winner's plan with the tune's server settings, named for it."""
    if top.winner is None:
        return None
    won = next(c for c in candidates if c.key == top.winner)
    return won.plan.with_changes(name=f"serve-tuned-{top.winner}", server=tuple(sorted(request.settings.items())))


def _server_for(candidate: Candidate, request: ServeTuneRequest) -> CandidateServer:
    return CandidateServer(
        key=candidate.key,
        model=request.model,
        served_name=request.spec.name,
        settings=request.settings,
        # every request is answered, however long the queue: the load, not a timeout, is measured
        extra_args=("--max-queue", "1024", "--request-timeout", "600", "--max-tokens", str(max(request.max_tokens))),
    )
