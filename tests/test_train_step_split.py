"""The step split (train/step_split.py), the training MFU (train/mfu.py), the bench rows and their
selection (train/bench.py, --bench-rows), on a fake clock and fake device facts: milliseconds.

The compile row's own run is proved end to end in test_train_e2e.py; here its construction."""

from __future__ import annotations

import pytest
from fake_clock import FakeClock
from rich.console import Console

from accelab.measure.hardware import HardwareLimits
from accelab.results import contract as K
from accelab.results.result import Result
from accelab.train import bench
from accelab.train.bench import rows_json
from accelab.train.bench_rows import ROWS, bench_rows, row_techniques
from accelab.train.config import TrainConfig
from accelab.train.mfu import row_peak, train_mfu
from accelab.train.report import bench_table, metrics_of
from accelab.train.run_options import BENCH_ROW_KEYS, TrainRun, bench_row_keys
from accelab.train.step_split import StepSplit, comm_of, split_shares, split_text, summarize_split, union_seconds
from accelab.train.timing import StepTimer


def make_config(**changes) -> TrainConfig:
    return TrainConfig(model="m", model_source="/m", output_dir="/out", **changes)


def one_step(clock: FakeClock, split: StepSplit, timer: StepTimer, ms: dict[str, float], micro: int = 1) -> None:
    """One optimizer step as loop._one_epoch marks it: per micro-step data, forward, backward,
    optimizer; then the loss sync before the timer's step end ("other")."""
    for _ in range(micro):
        for phase in ("data", "forward", "backward", "optimizer"):
            clock.advance(ms[phase] / 1000)
            split.mark(phase)  # type: ignore[arg-type]
    clock.advance(ms["other"] / 1000)
    timer.step_done(0)


# the split: marks on the StepTimer's step boundaries ------------------------------------------
def test_phases_add_up_to_each_timed_step_and_micro_steps_accumulate(clock):
    split = StepSplit(clock=clock)
    timer = StepTimer(warmup=1, clock=clock, split=split)
    timer.start()
    one_step(clock, split, timer, {"data": 50, "forward": 500, "backward": 900, "optimizer": 100, "other": 1})
    for _ in range(3):  # 2 accumulation micro-steps per optimizer step
        one_step(clock, split, timer, {"data": 1, "forward": 3, "backward": 5, "optimizer": 0.5, "other": 0.5}, 2)
    assert [sum(s.values()) for s in split.steps] == pytest.approx(timer.durations, rel=1e-12)
    assert split.steps[1] == pytest.approx(
        {"data": 0.002, "forward": 0.006, "backward": 0.010, "optimizer": 0.001, "other": 0.0005}
    )
    summary = timer.summary(global_batch=16, steps_per_epoch=10, full_epochs=[])["split"]
    assert summary["steps"] == 3  # the warm-up step (compilation, first calls) left out, as for samples/s
    assert summary["total_s"] == pytest.approx(timer.summary(16, 10, [])["timed_wall_s"], rel=1e-12)
    assert summary["phases"]["backward"] == pytest.approx({"p50_ms": 10.0, "share": 10 / 19.5})
    assert sum(p["share"] for p in summary["phases"].values()) == pytest.approx(1.0)
    assert summary["communication"] is None and summary["comm"] == "none"


def test_a_pause_or_a_bench_turn_drops_what_was_marked_since_the_step_began(clock):
    split = StepSplit(clock=clock)
    timer = StepTimer(warmup=0, clock=clock, split=split)
    timer.start()
    clock.advance(0.004)
    split.mark("data")
    clock.advance(30.0)  # e.g. the FLOPs count before the first forward, or another row's turn
    timer.start()
    one_step(clock, split, timer, {"data": 2, "forward": 3, "backward": 4, "optimizer": 1, "other": 0})
    assert timer.durations == pytest.approx([0.010]) and split.steps[0]["data"] == pytest.approx(0.002)


def test_the_loops_bookkeeping_after_a_step_is_the_next_steps_other_not_its_data(clock):
    split = StepSplit(clock=clock)
    timer = StepTimer(warmup=0, clock=clock, split=split)
    timer.start()
    one_step(clock, split, timer, {"data": 1, "forward": 1, "backward": 1, "optimizer": 1, "other": 1})
    clock.advance(0.007)  # logging, the progress bar, the turn gate's file: loop._after_step marks it
    split.mark("other")
    one_step(clock, split, timer, {"data": 1, "forward": 1, "backward": 1, "optimizer": 1, "other": 1})
    assert split.steps[1]["data"] == pytest.approx(0.001) and split.steps[1]["other"] == pytest.approx(0.008)


def test_the_device_is_synced_before_every_mark():
    calls: list[str] = []
    split = StepSplit(clock=lambda: 1.0, sync=lambda: calls.append("sync"))
    split.restart(1.0)
    split.mark("forward")
    split.mark("backward")
    assert calls == ["sync", "sync"]


def test_overlapping_allreduces_count_once_and_are_reported_beside_backward(clock):
    assert union_seconds([]) == 0
    assert union_seconds([(0.0, 1.0), (2.0, 3.0)]) == pytest.approx(2.0)  # apart
    assert union_seconds([(0.0, 2.0), (1.0, 3.0), (1.5, 1.6)]) == pytest.approx(3.0)  # overlapping, nested
    split = StepSplit(clock=clock, comm="ddp")
    timer = StepTimer(warmup=0, clock=clock, split=split)
    timer.start()
    clock.advance(0.002)
    split.mark("forward")
    first = split.comm_started()  # DDP launches a bucket while backward goes on ...
    clock.advance(0.003)
    second = split.comm_started()
    clock.advance(0.001)
    split.comm_done(first)
    clock.advance(0.002)
    split.comm_done(second)  # ... and waits for the last one
    clock.advance(0.002)  # the first layers' gradients
    split.mark("backward")
    timer.step_done(0)
    summary = split.summary(warmup=0)
    assert summary["communication"] == pytest.approx({"p50_ms": 6.0, "share": 6 / 10})
    assert summary["phases"]["backward"]["share"] == pytest.approx(8 / 10)  # not added: it overlaps
    assert "overlapped with backward" in summary["comm_note"]
    assert split_text(summary) == "data 0% · fwd 20% · bwd 80% · opt 0% · comm 60% in bwd"


def test_where_the_communication_is_by_processes_and_sharding():
    assert comm_of(1, "ddp") == "none" and comm_of(1, "fsdp") == "none"
    assert comm_of(2, "ddp") == "ddp" and comm_of(4, "fsdp") == "fsdp"
    steps = [{"data": 0.01, "forward": 0.3, "backward": 0.6, "optimizer": 0.09, "other": 0.0}]
    fsdp = summarize_split(steps, None, comm="fsdp")
    assert fsdp is not None and "inside forward and backward" in fsdp["comm_note"]
    assert split_text(fsdp) == "data 1% · fwd 30% · bwd 60% · opt 9% · comm in fwd/bwd"
    shares = {"data": 0.01, "forward": 0.3, "backward": 0.6, "optimizer": 0.09, "other": 0.0, "communication": None}
    assert split_shares(fsdp) == pytest.approx(shares)
    assert summarize_split([], None) is None and split_text(None) == "-"


# MFU -----------------------------------------------------------------------------------------
def test_the_peak_follows_the_threads_or_devices_a_row_used():
    assert row_peak(100e9, measured_threads=2, threads=1, processes=1, cuda=False) == pytest.approx(50e9)
    assert row_peak(100e9, measured_threads=2, threads=1, processes=2, cuda=False) == pytest.approx(100e9)
    assert row_peak(100e9, measured_threads=2, threads=2, processes=2, cuda=False) == pytest.approx(100e9)  # cores
    assert row_peak(700e12, measured_threads=16, threads=4, processes=2, cuda=True) == pytest.approx(1400e12)


def test_mfu_is_three_forwards_per_sample_and_never_above_100_percent():
    figures = train_mfu(forward_flops_per_sample=1e9, samples_per_s=10.0, peak_flops=100e9, path="fp32")
    assert figures == {K.ACHIEVED_FLOPS: pytest.approx(30e9), K.MFU: pytest.approx(0.3)}
    over = train_mfu(forward_flops_per_sample=1e9, samples_per_s=50.0, peak_flops=100e9, path="bf16-autocast")
    assert (
        K.MFU not in over
        and "peak was underestimated" in over[K.MFU_UNKNOWN]
        and "150.0 GFLOP/s" in over[K.MFU_UNKNOWN]
    )
    assert (
        "accelab env"
        in train_mfu(forward_flops_per_sample=1e9, samples_per_s=1.0, peak_flops=None, path="fp32")[K.MFU_UNKNOWN]
    )
    assert (
        "not counted"
        in train_mfu(forward_flops_per_sample=None, samples_per_s=1.0, peak_flops=1.0, path="fp32")[K.MFU_UNKNOWN]
    )


def limits(threads: int = 2) -> HardwareLimits:
    return HardwareLimits(
        device="cpu",
        fp32_flops=200e9,
        bf16_flops=100e9,
        tf32_flops=None,
        bandwidth_bytes_per_s=20e9,
        threads=threads,
        measured_at="2026-12-05T00:00:00+00:00",
        fingerprint="f",
        bf16_autocast_flops=160e9,
    )


def bench_result(name: str, *, precision: str = "fp32", nproc: int = 1, threads: int = 1) -> Result:
    """A `train --bench` row's Result as report.result_of builds it from a worker's summary with a split."""
    clock = FakeClock()
    split = StepSplit(clock=clock, comm=comm_of(nproc, "ddp"), forward_flops_per_sample=1e9)
    timer = StepTimer(warmup=1, clock=clock, split=split)
    timer.start()
    for _ in range(3):
        one_step(clock, split, timer, {"data": 5, "forward": 300, "backward": 600, "optimizer": 90, "other": 5})
    summary = {
        "timing": timer.summary(16, 10, []),
        **{"losses": [2.0, 1.9, 1.8], "evals": [], "final": {}, "total_steps": 3, "skipped_steps": 0},
        **{"threads": threads, "device": "cpu"},
        "memory": {"peak_rss_mb_per_rank": [800.0] * nproc, "peak_rss_mb_max": 800.0, "peak_rss_mb_sum": 800.0 * nproc}
        | {"gpu_peak_allocated_mb_max": None},
    }
    return Result(
        kind="train",
        status="ok",
        model={"name": "m", "task": "image-classification"},
        plan={"name": name, "precision": precision},
        workload={"world_size": nproc, "nproc": nproc},
        metrics=metrics_of(summary),
    )


def test_a_bench_rows_mfu_uses_its_precisions_peak_scaled_to_its_threads():
    fp32, bf16 = bench_result("baseline (fp32)"), bench_result("bf16 autocast", precision="bf16-autocast")
    for r in (fp32, bf16):
        bench._add_mfu(r, limits(threads=2), cuda=False)
        assert K.TRAIN_BENCH.unnamed(r.metrics) == []
    sps = fp32.metrics[K.SAMPLES_PER_S]
    assert sps == pytest.approx(16 / 1.0)  # 16 samples per 1.0 s step
    assert fp32.metrics[K.HARDWARE] == {
        "compute_path": "fp32",
        "peak_flops": pytest.approx(100e9),  # 1 thread of the 2 the peak was measured at
        "measured_flops": 200e9,
        "measured_threads": 2,
    }
    assert fp32.metrics[K.MFU] == pytest.approx(3e9 * sps / 100e9)
    assert bf16.metrics[K.MFU] == pytest.approx(3e9 * sps / 80e9) and bf16.metrics[K.HARDWARE]["compute_path"] == (
        "bf16-autocast"
    )
    unmeasured = bench_result("baseline (fp32)")
    bench._add_mfu(unmeasured, None, cuda=False)
    assert "accelab env" in unmeasured.metrics[K.MFU_UNKNOWN] and K.HARDWARE not in unmeasured.metrics


def test_the_bench_table_and_json_show_the_split_and_the_mfu():
    ddp = bench_result("2 processes", nproc=2)
    results = [bench_result("baseline (fp32)"), ddp]
    for r in results:
        bench._add_mfu(r, limits(), cuda=False)
    console = Console(record=True, width=240)
    bench_table(results, title="t", console=console)
    text = console.export_text()
    assert "data 0% · fwd 30% · bwd 60% · opt 9%" in text and "MFU" in text
    assert f"{results[0].metrics[K.MFU]:.1%}" in text
    assert "2 processes: communication (overlapped with backward)" in text
    row = rows_json(results)[0]
    assert row["mfu"] == results[0].metrics[K.MFU] and row["step_split"]["backward"] == pytest.approx(0.6)


# rows and --bench-rows ------------------------------------------------------------------------
def test_bench_rows_picks_rows_in_order_always_with_the_baseline():
    assert bench_row_keys(None) == BENCH_ROW_KEYS and set(ROWS) == set(BENCH_ROW_KEYS)
    assert bench_row_keys("workers, compile") == ("baseline", "compile", "workers")
    assert bench_row_keys("baseline") == ("baseline",)
    with pytest.raises(ValueError, match="unknown row.*nope.*choose from baseline,bf16,fp16,accum,ddp,compile"):
        bench_row_keys("compile,nope")
    with pytest.raises(ValueError, match="--bench-rows 'fdsp': unknown row"):
        TrainRun(bench=True, bench_rows="fdsp")
    with pytest.raises(ValueError, match="add --bench"):
        TrainRun(bench_rows="compile")


def test_the_new_rows_change_one_thing_each_or_say_why_not():
    config = make_config(batch_size=16)
    facts = {"cuda": False, "bf16_on_gpu": None, "gpus": 0, "nproc": 2, "accum": 4}
    rows = {r.key: r for r in bench_rows(config, **facts, only="compile,checkpointing,workers,fsdp")}
    assert list(rows) == ["baseline", "compile", "checkpointing", "workers", "fsdp"]
    assert rows["compile"].changes == {"compile": "default"} and row_techniques(rows["compile"]) == ["compile"]
    assert (
        rows["checkpointing"].changes == {"gradient_checkpointing": True} and rows["checkpointing"].unsupported is None
    )
    assert rows["workers"].changes == {"loader_workers": 2}
    assert rows["fsdp"].changes == {"sharding": "fsdp"} and rows["fsdp"].nproc == 2
    assert rows["fsdp"].name == "fsdp (2 processes)" and rows["fsdp"].unsupported is None
    assert all(r.unsupported is None for r in rows.values())

    no_ckpt = "m (ResNetForImageClassification) does not support gradient checkpointing in transformers"
    rows = {r.key: r for r in bench_rows(config, **facts, only="checkpointing", checkpointing=no_ckpt)}
    assert rows["checkpointing"].unsupported == no_ckpt
    compiled = {r.key: r for r in bench_rows(make_config(compile="default", loader_workers=2), **facts)}
    assert (
        "nothing to compare" in compiled["compile"].unsupported
        and "loader_workers=2" in compiled["workers"].unsupported
    )
    assert "--compile" in compiled["fsdp"].unsupported  # options.py's rule for FSDP runs, not compiled here
    odd = {r.key: r for r in bench_rows(make_config(batch_size=15), **facts, only="ddp,fsdp")}
    assert "does not split" in odd["ddp"].unsupported and "does not split" in odd["fsdp"].unsupported
