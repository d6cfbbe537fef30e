"""The Result contract (accelab.results.contract): each producer writes only the keys its
contract names, and the report reads what the producers write. Results here come from the real
producer functions (run_forward, run_generate, BenchMeasurer, summarize_run / find_max /
build_result, metrics_of) on fakes: a fake runnable, fake request records, a fake clock."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import torch
from rich.console import Console

from accelab.loadtest import run as loadtest_run
from accelab.loadtest.client import LoadConfig
from accelab.loadtest.findmax import find_max, goodput_at_least
from accelab.loadtest.summary import RequestRecord, parse_slo, summarize_run
from accelab.report import metrics as M, series as S
from accelab.report.regress import metric_specs
from accelab.results import contract as K
from accelab.results.result import Result
from accelab.scenarios.workload import Workload

SRC = Path(__file__).parents[1] / "src" / "accelab"
CONTRACTS = [
    K.FORWARD,
    K.GENERATE,
    K.TUNE_FORWARD,
    K.TUNE_GENERATE,
    K.LOADTEST,
    K.PROBE,
    K.FIND_MAX,
    K.TUNE_SERVE,
    K.LOADTEST_WORKLOAD,
    K.TRAIN,
    K.TRAIN_BENCH,
    K.EVAL,
]


# -- the contract itself ----------------------------------------------------------------------------
def test_every_key_name_is_in_a_contract_with_a_meaning():
    names = {v for k, v in vars(K).items() if k.isupper() and isinstance(v, str)}
    named = set().union(*(c.names for c in CONTRACTS))
    assert names - named == {K.TRACEBACK}  # the crashed run's only key, of every kind
    assert named - names == set(), "a contract names a key no constant spells"
    for contract in CONTRACTS:
        assert len(contract.names) == len(contract.keys), f"{contract.producer}: a key named twice"
        assert all(key.meaning for key in contract.keys)


@pytest.mark.parametrize(
    "path",
    [
        "benchmark/engine.py",
        "benchmark/child.py",
        "benchmark/rounds.py",
        "scenarios/forward.py",
        "scenarios/generate.py",
        "loadtest/summary.py",
        "loadtest/run.py",
        "train/report.py",
        "tuner/measure.py",
        "tuner/serve_window.py",
    ],
)
def test_producers_write_metrics_only_through_the_contract_names(path):
    """A literal key in a producer would bypass the contract (the runtime checks below cover the
    dicts they build; this covers the engine's additions, which need a real model to run)."""
    text = (SRC / path).read_text()
    assert not re.findall(r"(?:metrics|figures|out)\[\s*[\"'][^\"']*[\"']\s*\]\s*=", text)


# -- bench: forward and generate on a fake runnable -------------------------------------------------
class FakeRunnable:
    """A Runnable with the fields the scenarios use: forward/generate and the device (CPU)."""

    device = torch.device("cpu")
    processor = None

    def __init__(self, new_tokens: int = 4):
        self.new_tokens = new_tokens

    def forward(self, batch):
        return batch["input_ids"] * 2

    def generate(self, batch, *, max_new_tokens, min_new_tokens, do_sample, stopping_criteria):
        ids = batch["input_ids"]
        for _ in range(max_new_tokens):
            ids = torch.cat([ids, ids[:, -1:] + 1], dim=1)
            for criterion in stopping_criteria:
                criterion(ids, None)
        return ids


QUICK = dict(warmup=1, min_iters=5, min_seconds=0.0, max_seconds=5.0)
ENGINE_FIGURES = {
    K.LOAD_S: 0.5,
    K.PEAK_RSS_MB: 300.0,
    K.PEAK_MEMORY_MB: 250.0,
    K.DEVICE: "cpu",
    K.THREADS: {"intra_op": 2, "inter_op": 2},
}


def bench_result(metrics: dict, scenario: str, batch: int = 2, kind: str = "bench", plan: str = "baseline") -> Result:
    return Result(
        kind=kind,
        status="ok",
        model={"name": "fake", "task": "text-generation"},
        plan={"name": plan, "batch_size": batch},
        workload=Workload(scenario=scenario, batch_size=batch, **QUICK).to_dict(),
        metrics={**metrics, **ENGINE_FIGURES},
    )


def forward_metrics(batch: int = 2) -> dict:
    from accelab.scenarios.forward import run_forward

    workload = Workload(scenario="forward", batch_size=batch, **QUICK)
    return run_forward(FakeRunnable(), {"input_ids": torch.ones(batch, 8)}, workload)


def test_forward_writes_only_contract_keys_and_the_report_reads_them():
    metrics = forward_metrics()
    assert K.FORWARD.unnamed(metrics) == []
    r = bench_result(metrics, "forward")
    assert K.FORWARD.unnamed(r.metrics) == []
    assert M.latency_stats(r) == metrics[K.LATENCY_MS] and M.stat(r, "n") == metrics[K.ITERATIONS]
    assert M.throughput(r) == metrics[K.THROUGHPUT] and M.throughput_unit(r) == "items/s"
    assert M.peak_memory_mb(r) == 250.0
    (panel,) = S.latency_panels([r])
    assert panel.curves[0].from_samples and len(panel.curves[0].xs) == metrics[K.ITERATIONS]
    assert [spec.read(r) for spec in metric_specs(r)] == [
        metrics[K.LATENCY_MS]["p50"],
        metrics[K.LATENCY_MS]["p99"],
        metrics[K.THROUGHPUT],
        250.0,
    ]


def test_generate_writes_only_contract_keys_and_the_report_reads_them():
    pytest.importorskip("transformers")
    from accelab.scenarios.generate import run_generate

    workload = Workload(scenario="generate", batch_size=2, new_tokens=4, **QUICK)
    metrics = run_generate(FakeRunnable(), {"input_ids": torch.ones(2, 3, dtype=torch.long)}, workload)
    assert K.GENERATE.unnamed(metrics) == []
    r = bench_result(metrics, "generate")
    assert M.latency_stats(r) == metrics[K.E2E_MS] and M.throughput_unit(r) == "tokens/s"
    specs = {spec.label: spec.read(r) for spec in metric_specs(r)}
    assert specs["e2e p50"] == metrics[K.E2E_MS]["p50"] and specs["TTFT p50"] == metrics[K.TTFT_MS]["p50"]
    assert specs["TPOT p50"] == metrics[K.TPOT_MS]["p50"] and specs["throughput"] == metrics[K.THROUGHPUT]


# -- tune: BenchMeasurer around a fake bench --------------------------------------------------------
def test_tune_trials_carry_the_tune_keys_and_make_a_pareto_set(monkeypatch):
    from accelab.tuner import measure
    from accelab.tuner.search import Candidate

    def fake_bench(spec, plan, workload, **kw):
        metrics = forward_metrics(workload.batch_size)
        r = bench_result(metrics, "forward", batch=workload.batch_size, kind=kw["kind"], plan=plan.name)
        r.group_id = kw["group_id"]
        return r

    monkeypatch.setattr(measure, "bench", fake_bench)
    measurer = measure.BenchMeasurer(
        spec=None,
        workload=Workload(scenario="forward", **QUICK),
        device=None,  # type: ignore[arg-type]  # the faked bench never reads it
        store=None,
        group_id="tune-x",
        quality=None,
        tolerance="balanced",
        console=Console(file=io.StringIO()),
    )
    for variant, batch, phase in (
        ("baseline", 1, "screen"),
        ("baseline", 2, "grow"),
        ("bf16", 2, "screen"),
        ("baseline", 2, "final"),
    ):
        m = measurer(Candidate(variant=variant, batch_size=batch), phase)
        assert m.status == "ok" and m.throughput == measurer.results[-1].metrics[K.THROUGHPUT]
    for r in measurer.results:
        assert K.TUNE_FORWARD.unnamed(r.metrics) == []
    (ps,) = S.pareto_sets(measurer.results)
    assert sorted(p.label for p in ps.points) == ["baseline@1", "baseline@2", "bf16@2"]
    final = next(r for r in measurer.results if r.metrics[K.TUNE_PHASE] == "final")
    assert next(p for p in ps.points if p.label == "baseline@2").run_id == final.run_id  # the final run counts


# -- loadtest: summarize_run, find_max, build_result on fake records --------------------------------
def records(rate: float, latency_s: float, n: int = 20, ttft_s: float | None = None) -> list[RequestRecord]:
    """n requests sent at `rate`, each answered after `latency_s` (2 tokens, one chunk each)."""
    out = []
    for i in range(n):
        start = i / rate
        ttft = ttft_s if ttft_s is not None else latency_s / 2
        out.append(
            RequestRecord(
                start=start,
                end=start + latency_s,
                status="200",
                ttft=ttft,
                chunk_times=[start + ttft, start + latency_s],
                output_tokens=2,
                prompt_tokens=5,
            )
        )
    return out


@pytest.fixture
def no_server(monkeypatch):
    monkeypatch.setattr(loadtest_run, "server_info", lambda config: {"task": "text-generation", "plan": "baseline"})


def config(**kw) -> LoadConfig:
    return LoadConfig(url="http://127.0.0.1:9", inputs=("hello",), **({"rate": 1.0} | kw))


def test_a_load_test_run_writes_only_contract_keys(no_server):
    slo = parse_slo("e2e=100ms")
    summary = summarize_run(records(4.0, 0.05), slo, offered_rate=4.0)
    assert K.LOADTEST.unnamed(summary) == [] and K.LOADTEST.names == set(summary)
    r = loadtest_run.build_result(config(rate=4.0), "fake", slo, summary=summary)
    assert K.LOADTEST.unnamed(r.metrics) == [] and K.LOADTEST_WORKLOAD.names <= set(r.workload)
    assert M.latency_stats(r) == summary[K.E2E_MS] and M.throughput(r) == summary[K.REQUEST_THROUGHPUT]
    assert M.throughput_unit(r) == "req/s" and M.peak_memory_mb(r) is None


def test_single_runs_at_several_rates_make_a_load_curve(no_server):
    slo = parse_slo("e2e=100ms")
    runs = [
        loadtest_run.build_result(
            config(rate=rate), "fake", slo, summary=summarize_run(records(rate, latency), slo, offered_rate=rate)
        )
        for rate, latency in ((8.0, 0.09), (2.0, 0.04), (4.0, 0.045))
    ]
    (curve,) = S.load_curves(runs)
    assert curve.load_name == "offered_rate" and curve.latency_name == "e2e_ms"
    assert [p.load for p in curve.points] == [2.0, 4.0, 8.0]
    assert [p.p50 for p in curve.points] == pytest.approx([40.0, 45.0, 90.0])
    assert curve.slo_ms == pytest.approx(100.0) and curve.max_load is None
    assert curve.points[0].served == pytest.approx(runs[1].metrics[K.REQUEST_THROUGHPUT])
    assert curve.points[0].goodput == pytest.approx(runs[1].metrics[K.GOODPUT_RATE])


def test_closed_loop_runs_are_plotted_against_their_users(no_server):
    slo = parse_slo(None)
    runs = [
        loadtest_run.build_result(
            config(rate=None, concurrency=users), "fake", slo, summary=summarize_run(records(10.0, 0.01 * users), slo)
        )
        for users in (1, 4, 2)
    ]
    (curve,) = S.load_curves(runs)
    assert curve.load_name == "concurrency" and [p.load for p in curve.points] == [1.0, 2.0, 4.0]
    assert [p.p99 for p in curve.points] == pytest.approx([10.0, 20.0, 40.0]) and curve.slo_ms is None


def test_find_max_writes_only_contract_keys_and_draws_its_probes(no_server):
    slo = parse_slo("e2e=100ms")

    def measure(rate: float) -> dict:  # the server holds 10 req/s: past that, latency grows
        latency = 0.04 if rate <= 10 else 0.04 * rate / 5
        return summarize_run(records(rate, latency), slo, offered_rate=rate)

    search = find_max(measure, goodput_at_least(0.95), start_rate=2.0, max_steps=6)
    r = loadtest_run.build_result(config(rate=2.0), "fake", slo, search=search, goodput_target=0.95)
    assert K.FIND_MAX.unnamed(r.metrics) == []
    for probe in r.metrics[K.PROBES]:
        assert K.PROBE.unnamed(probe) == [] and K.PROBE.names == set(probe)
    (curve,) = S.load_curves([r])
    assert curve.load_name == "rate" and curve.max_load == search.best_rate
    assert [p.load for p in curve.points] == sorted(p.rate for p in search.probes)
    assert curve.points[-1].p99 > curve.points[0].p99 and curve.slo_ms == pytest.approx(100.0)
    assert f"max {search.best_rate:g} req/s under SLO" in M.key_metric(r)


# -- train: metrics_of on a worker's summary -------------------------------------------------------
def train_summary(steps: int = 6) -> dict:
    """A worker's summary as train/worker.py builds it: StepTimer on a fake clock, evals shaped
    like train/loop.py's (evaluate's figures, then epoch and step)."""
    from accelab.train.timing import StepTimer

    now = [0.0]
    timer = StepTimer(warmup=1, clock=lambda: now[0])
    timer.start()
    for i in range(steps):
        now[0] += 0.5 if i == 0 else 0.2
        timer.step_done(i // 3)
    losses = [2.0 - 0.1 * i for i in range(steps)]
    evals = [
        {K.ACCURACY: 0.5 + 0.1 * e, K.LOSS: 1.5 - 0.2 * e, K.SAMPLES: 40, K.EPOCH: e, K.STEP: 3 * (e + 1)}
        for e in range(2)
    ]
    return {
        "timing": timer.summary(16, 3, [0, 1]),
        "losses": losses,
        "evals": evals,
        "final": evals[-1],
        "total_steps": steps,
        "skipped_steps": 0,
        "threads": 2,
        "device": "cpu",
        "memory": {
            "peak_rss_mb_per_rank": [800.0],
            "peak_rss_mb_max": 800.0,
            "peak_rss_mb_sum": 800.0,
            "gpu_peak_allocated_mb_per_rank": None,
            "gpu_peak_allocated_mb_max": None,
        },
    }


def test_train_writes_only_contract_keys_and_the_report_reads_them():
    from accelab.train.report import metrics_of

    metrics = {**metrics_of(train_summary()), K.WALL_S: 12.0}
    assert K.TRAIN.unnamed(metrics) == []
    for e in metrics[K.EVALS]:
        assert K.EVAL.unnamed(e) == []
    r = Result(
        kind="train",
        status="ok",
        model={"name": "fake", "task": "image-classification"},
        plan={"name": "baseline", "batch_size": 16},
        workload={"scenario": "train-step", "global_batch": 16, "nproc": 1, "nnodes": 1},
        metrics=metrics,
    )
    assert M.throughput(r) == pytest.approx(16 / 0.2) and M.throughput_unit(r) == "samples/s"
    assert M.epoch_seconds(r) == pytest.approx(0.6) and M.peak_memory_mb(r) == 800.0
    assert S.final_accuracy(r) == pytest.approx(0.6) and M.batch_size(r) == 16
    (curve,) = S.train_curves([r])
    assert curve.steps == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0] and curve.losses == pytest.approx(metrics[K.LOSSES])
    assert curve.eval_x == [3.0, 6.0] and curve.eval_accuracy == pytest.approx([0.5, 0.6])
    assert curve.eval_loss == pytest.approx([1.5, 1.3])
    assert {spec.label: spec.read(r) for spec in metric_specs(r)}["step p50"] == pytest.approx(200.0)


def test_train_bench_rows_write_only_contract_keys():
    """A `train --bench` row: its turns, their noise and its paired speed-up over the first row
    (accelab.train.bench._add_rounds on rows with fixed step times and fake noise windows)."""
    from accelab.launch import LaunchOptions
    from accelab.measure.noise import Window
    from accelab.train import bench
    from accelab.train.config import TrainConfig
    from accelab.train.report import metrics_of

    quiet = Window(seconds=1.0, steal=0.0, others_cores=0.0, throttled=0.0, load1=0.1)

    def running(name: str, step_s: float) -> bench._Running:
        r = bench._Running(
            row=bench.BenchRow(name=name),
            slug=name,
            config=TrainConfig(model="m", model_source="/m", output_dir="/out", batch_size=16),
            launch=LaunchOptions(),
            techniques=[],
        )
        r.rounds = [[step_s] * 4 for _ in range(4)]
        r.windows = [quiet] * 4
        return r

    first, second = running("baseline (fp32)", 0.2), running("bf16", 0.1)
    results = []
    for r in (first, second):
        result = Result(kind="train", status="ok", model={}, plan={}, workload={}, metrics=metrics_of(train_summary()))
        bench._add_rounds(result, r, first)
        assert K.TRAIN_BENCH.unnamed(result.metrics) == []
        results.append(result)
    assert K.SPEEDUP not in results[0].metrics and results[1].metrics[K.SPEEDUP]["value"] == pytest.approx(2.0)
    assert [turn["rate"] for turn in results[1].metrics[K.ROUNDS]] == pytest.approx([160.0] * 4)
    assert results[1].metrics[K.NOISE]["level"] == "quiet" and results[1].metrics[K.NOISE]["rounds_used"] == 4


def test_train_on_a_gpu_reads_the_gpu_peak():
    from accelab.train.report import metrics_of

    summary = train_summary()
    summary["memory"] = {**summary["memory"], "gpu_peak_allocated_mb_max": 3000.0}
    r = Result(kind="train", status="ok", model={}, plan={}, workload={}, metrics=metrics_of(summary))
    assert M.peak_memory_mb(r) == 3000.0
