"""`accelab train --tune`'s pure parts: the candidate space, the finalists, the plan file."""

from __future__ import annotations

import math

import pytest

from accelab.launch import LaunchOptions
from accelab.train.config import TrainConfig
from accelab.train.options import plan_launch, plan_settings
from accelab.train.plan_file import TrainPlan, is_train_plan, read
from accelab.train.tune_space import BASELINE, Screened, candidates, finalists, only


def config(**changes) -> TrainConfig:
    return TrainConfig(
        **{"model": "m", "model_source": "/m", "output_dir": "/tmp/run", "batch_size": 16, "lr": 4e-4, **changes}
    )


def test_cpu_space_has_every_axis_and_says_why_fp16_cannot_run():
    space = candidates(config(), cuda=False, bf16_on_gpu=None, gpus=0, nproc=2)
    names = [c.name for c in space]
    assert names == [
        BASELINE,
        "bf16 autocast",
        "fp16 autocast",
        "compile",
        "activation checkpointing",
        "loader workers x2",
        "2 processes (DDP)",
        "2 processes (FSDP)",
        "batch 32 (lr x1.41)",
    ]
    by_name = {c.name: c for c in space}
    assert "needs a GPU" in by_name["fp16 autocast"].unsupported
    assert by_name["2 processes (FSDP)"].changes == {"sharding": "fsdp"} and by_name["2 processes (FSDP)"].nproc == 2
    batch = by_name["batch 32 (lr x1.41)"].changes
    assert batch["batch_size"] == 32 and batch["lr"] == pytest.approx(4e-4 * math.sqrt(2))  # the square-root rule


def test_space_leaves_out_what_the_baseline_already_does_and_checks_splits():
    space = candidates(
        config(mixed_precision="bf16", compile="default", batch_size=15), cuda=False, bf16_on_gpu=None, gpus=0, nproc=2
    )
    names = [c.name for c in space]
    assert "bf16 autocast" not in names and "compile" not in names
    assert "does not split" in next(c for c in space if c.name == "2 processes (DDP)").unsupported
    resnet = candidates(config(), cuda=False, bf16_on_gpu=None, gpus=0, nproc=2, checkpointing="no checkpointing")
    assert next(c for c in resnet if c.key == "checkpointing").unsupported == "no checkpointing"
    gpu = candidates(config(), cuda=True, bf16_on_gpu=True, gpus=1, nproc=2)
    assert "need 2 GPUs; 1 found" in next(c for c in gpu if c.key == "ddp").unsupported


def test_only_keeps_the_baseline_and_names_bad_keys():
    space = candidates(config(), cuda=False, bf16_on_gpu=None, gpus=0, nproc=2)
    assert [c.key for c in only(space, "batch, workers")] == [BASELINE, "workers", "batch"]
    assert only(space, None) == space
    with pytest.raises(ValueError, match="'fp8' unknown|fp8 unknown; choose from bf16"):
        only(space, "bf16,fp8")


def _screened(space, faster: dict[str, float]) -> list[Screened]:
    return [
        Screened(
            candidate=c,
            speedup=faster.get(c.name, 1.0),
            verdict="faster" if c.name in faster else "no measurable difference",
            out=None if c.name in faster or c.name == BASELINE else "slower",
        )
        for c in space
    ]


def test_finalists_combine_the_fastest_change_per_axis_then_the_singles():
    space = candidates(config(), cuda=False, bf16_on_gpu=None, gpus=0, nproc=2)
    screened = _screened(space, {"bf16 autocast": 1.3, "2 processes (DDP)": 1.6, "2 processes (FSDP)": 1.4})
    chosen = finalists(screened, 3)
    assert [c.name for c in chosen] == [
        "2 processes (DDP) + bf16 autocast",  # DDP beat FSDP on the processes axis
        "2 processes (DDP)",
        "2 processes (FSDP)",
    ]
    assert chosen[0].changes == {"sharding": "ddp", "mixed_precision": "bf16"} and chosen[0].nproc == 2
    assert [c.name for c in finalists(screened, 1)] == ["2 processes (DDP) + bf16 autocast"]
    one = finalists(_screened(space, {"compile": 1.2}), 3)
    assert [c.name for c in one] == ["compile"]  # one axis: nothing to combine
    assert finalists(_screened(space, {}), 3) == []  # everything slower: only the baseline trains
    undecided = [
        Screened(candidate=c, speedup=None, verdict="unreliable") if c.key == "batch" else s
        for c, s in zip(space, _screened(space, {"compile": 1.2}))
    ]
    assert [c.name for c in finalists(undecided, 3)] == ["compile", "batch 32 (lr x1.41)"]  # faster first


def test_train_plan_round_trip_and_what_train_plan_reads(tmp_path):
    plan = TrainPlan(
        name="bf16 autocast + 2 processes (DDP)",
        train={"mixed_precision": "bf16", "sharding": "ddp", "batch_size": 16, "lr": 4e-4},
        nproc=2,
        model="vit-tiny",
        dataset="digits",
        measured={"samples_per_s": 120.5, "convergence": "converges like the baseline"},
    )
    path = tmp_path / "train.yaml"
    path.write_text(plan.to_yaml("written by a test\nsecond line"))
    assert path.read_text().startswith("# written by a test\n# second line\nkind: train-plan\n")
    assert is_train_plan(str(path)) and read(path) == plan
    settings, notes = plan_settings(str(path))
    assert settings == plan.train and "bf16 autocast + 2 processes (DDP)" in notes[0]
    assert plan_launch(str(path), LaunchOptions()).nproc == 2  # the plan's processes
    assert plan_launch(str(path), LaunchOptions(nproc=3)).nproc == 3  # --nproc wins
    assert not is_train_plan("fp32") and plan_launch("fp32", LaunchOptions()).nproc == 1


def test_a_train_plan_with_a_wrong_field_says_which(tmp_path):
    with pytest.raises(ValueError, match="output_dir are not plan settings"):
        TrainPlan(name="p", train={"output_dir": "/x"})
    with pytest.raises(ValueError, match="lrate are not TrainConfig fields"):
        TrainPlan(name="p", train={"lrate": 1.0})
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: train-plan\nname: p\ntrain: [1, 2]\n")
    with pytest.raises(ValueError, match="must be a mapping"):
        read(bad)


# -- verdicts and the winner, from synthetic runs ---------------------------------------------------
def _run(name: str, *, rate: float, batch: int = 16, steps: int = 60, memory: float = 500.0, seed_shift: float = 0.0):
    """A Result as a convergence run reports it: loss decaying at `rate` per sample, evals every 10
    steps with the training wall time at 10 ms a step; accuracy rising as the loss falls."""
    from accelab.results.result import Result

    losses = [2.3 * math.exp(-rate * (i + 1) * batch) + 0.2 + seed_shift for i in range(steps)]
    evals = [
        {
            "step": s,
            "wall_s": s * 0.01,
            "loss": losses[s - 1],
            "accuracy": max(0.0, 1 - losses[s - 1] / 2.5),
            "samples": 360,
        }
        for s in range(10, steps + 1, 10)
    ]
    evals = [{**e, "samples": 360} for e in evals]
    return Result(
        kind="train",
        status="ok",
        model={"name": "m"},
        plan={"name": name},
        workload={"global_batch": batch},
        metrics={"losses": losses, "evals": evals, "samples_per_s": batch / 0.01, "peak_rss_mb_sum": memory},
    )


def _runs(*finalists):
    from accelab.train.tune_space import Candidate

    seeds = [
        (Candidate(name=BASELINE, axis=BASELINE), _run("baseline (seed 0)", rate=0.004)),
        (Candidate(name=BASELINE, axis=BASELINE), _run("baseline (seed 1)", rate=0.004, seed_shift=0.01)),
    ]
    return seeds + [(Candidate(name=r.plan["name"], axis="x"), r) for r in finalists]


def test_the_winner_reaches_the_target_first_and_a_diverging_or_too_big_plan_never_wins():
    from accelab.train.tune import TuneSettings, judge_all

    fast = _run("twice as fast per sample", rate=0.008)
    diverging = _run("lr too high", rate=-0.0005)  # the loss rises
    big = _run("over memory", rate=0.016, memory=5000.0)
    outcome = judge_all(_runs(fast, diverging, big), TuneSettings(max_memory_mib=1000.0), "image-classification")
    by_name = {j.result.plan["name"]: j for j in outcome.judged}
    assert outcome.winner is by_name["twice as fast per sample"]
    assert by_name["twice as fast per sample"].verdict == "converges like the baseline"
    assert by_name["lr too high"].verdict == "diverges" and by_name["lr too high"].out == "diverges"
    assert by_name["lr too high"].time_to_target_s is None
    assert by_name["over memory"].out == "over the memory limit: 5000 MiB > 1000 MiB"  # fastest, yet out
    seed0 = by_name["baseline (seed 0)"]
    assert seed0.time_to_target_s is not None  # the target is below the worse seed's score: every seed reaches it
    finals = [j.result.metrics["evals"][-1]["accuracy"] for j in outcome.judged[:2]]
    assert outcome.target == pytest.approx(2 * min(finals) - max(finals))  # the worse seed less the seeds' spread
    assert seed0.out.startswith("slower to the target") and by_name["baseline (seed 1)"].out is None
    assert outcome.winner.time_to_target_s < seed0.time_to_target_s


def test_a_failed_baseline_seed_gives_no_verdicts_and_says_why():
    from accelab.train.tune import TuneSettings, judge_all

    runs = _runs(_run("x", rate=0.008))
    runs[1][1].status, runs[1][1].reason = "error", "killed"
    outcome = judge_all(runs, TuneSettings(), "image-classification")
    assert outcome.winner is None and outcome.judged == []
    assert "a baseline seed did not finish (error: killed)" in outcome.notes[0]
