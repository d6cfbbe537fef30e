"""Pure parts of `accelab train`: config checks, batch arithmetic, data order, timing, checkpoint
resolution, option precedence, label fit, bench rows. Milliseconds each."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from accelab.train import checkpoint as ckpt
from accelab.train.accel import precision_problem
from accelab.train.bench_rows import bench_rows
from accelab.train.config import TrainConfig, epochs_needed, micro_batch, total_steps, warmup_for
from accelab.train.model import configure_processor, identity, image_size_for, label_fit
from accelab.train.optim import fused_supported, optimizer_and_schedule, param_groups
from accelab.train.options import default_name, merge, plan_settings
from accelab.train.progress import NoProgress
from accelab.train.sampler import EpochSampler
from accelab.train.timing import StepTimer


def make_config(**changes) -> TrainConfig:
    return TrainConfig(model="m", model_source="/m", output_dir="/out", **changes)


# optimizer ---------------------------------------------------------------------------------
def test_adamw_steps_with_its_fused_kernel_where_the_parameters_allow_it():
    import torch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.norm = torch.nn.LayerNorm(4)

    optimizer, scheduler = optimizer_and_schedule(make_config(weight_decay=0.05, lr=1e-3), Block(), 10)
    assert optimizer.defaults["fused"] is True  # Trainer's default too; 4x faster than foreach here
    decay, no_decay = optimizer.param_groups
    assert (len(decay["params"]), decay["weight_decay"]) == (1, 0.05)  # proj.weight only
    assert (len(no_decay["params"]), no_decay["weight_decay"]) == (3, 0.0)  # bias and the norm's two
    assert scheduler.get_last_lr()[0] < 1e-3  # warming up
    with torch.device("meta"):  # no fused kernel for this device: AdamW chooses its own path
        assert not fused_supported(param_groups(Block(), 0.05))
    assert not fused_supported([{"params": []}])


# config ------------------------------------------------------------------------------------
def test_global_batch_splits_over_processes_and_accumulation():
    assert micro_batch(32, 2, 4) == 4
    assert make_config(batch_size=32, world_size=2, grad_accum=2).per_process_batch == 8
    assert make_config(batch_size=32, world_size=2, grad_accum=2).loader_batch == 16
    with pytest.raises(ValueError, match=r"divisible by processes x grad-accum = 3 x 1 = 3.*--batch-size 30, 33"):
        micro_batch(32, 3, 1)


@pytest.mark.parametrize(
    "field,value,fragment",
    [
        ("mixed_precision", "fp8", "mixed_precision='fp8' is not allowed"),
        ("schedule", "step", "--schedule"),
        ("epochs", 0, "--epochs 1 or more"),
        ("warmup_ratio", 1.5, "warmup_ratio=1.5"),
        ("lr", 0.0, "--lr"),
        ("max_grad_norm", -1.0, "--max-grad-norm"),
    ],
)
def test_config_rejects_bad_values_naming_the_option(field, value, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        make_config(**{field: value})


def test_config_round_trips_through_json():
    config = make_config(batch_size=16, grad_accum=2, mixed_precision="bf16")
    assert TrainConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(ValueError, match="unknown TrainConfig field"):
        TrainConfig.from_dict({**config.to_dict(), "bogus": 1})


def test_steps_and_warmup():
    assert total_steps(make_config(epochs=3), 44) == 132
    assert total_steps(make_config(epochs=3, max_steps=100), 44) == 100  # max_steps wins, across epochs
    assert epochs_needed(100, 44) == 3
    assert warmup_for(make_config(warmup_ratio=0.1), 132) == 13
    assert warmup_for(make_config(warmup_steps=500), 132) == 132


# data order --------------------------------------------------------------------------------
def test_epoch_sampler_is_a_function_of_seed_and_epoch_cut_to_whole_batches():
    sampler = EpochSampler(103, seed=5, multiple_of=10)
    assert len(sampler) == 100
    first = list(sampler)
    assert len(set(first)) == 100 and list(sampler) == first  # same epoch: same order
    sampler.set_epoch(1)
    second = list(sampler)
    assert second != first
    again = EpochSampler(103, seed=5, multiple_of=10)
    again.set_epoch(1)
    assert list(again) == second  # a fresh process (resume) rebuilds the same order
    assert not hasattr(sampler, "generator")  # accelerate must not try to synchronise it
    with pytest.raises(ValueError, match="fewer than one global batch"):
        EpochSampler(5, seed=0, multiple_of=8)


def test_split_batches_gives_every_step_the_same_samples_for_1_and_2_processes():
    """accelerate (split_batches=True) gives rank r the r-th slice of each loader batch; the union
    over ranks of one optimizer step's slices equals the one-process batch."""
    order = EpochSampler(64, seed=0, multiple_of=16).order()
    one_process = [order[i : i + 16] for i in range(0, 64, 16)]
    for batch in one_process:
        ranks = [batch[r * 8 : (r + 1) * 8] for r in range(2)]
        assert sorted(ranks[0] + ranks[1]) == sorted(batch)


# timing ------------------------------------------------------------------------------------
def test_step_timer_excludes_warmup_and_pauses_from_throughput(clock):
    timer = StepTimer(warmup=1, clock=clock)
    timer.start()
    for duration in (5.0, 1.0, 1.0, 2.0):  # the first step is the slow warm-up
        clock.advance(duration)
        timer.step_done(epoch=0)
        if duration == 1.0:
            with timer.paused():
                clock.advance(100.0)  # an eval: must count toward no step
    summary = timer.summary(global_batch=8, steps_per_epoch=4, full_epochs=[0])
    assert timer.durations == [5.0, 1.0, 1.0, 2.0]
    assert summary["timed_steps"] == 3 and summary["timed_samples"] == 24
    assert summary["timed_wall_s"] == 4.0
    assert summary["samples_per_s"] == pytest.approx(24 / 4.0)  # samples / wall time of the timed steps
    assert summary["epoch_s"] == 9.0 and summary["epoch_s_estimated"] is False


def test_step_timer_estimates_the_epoch_when_none_completed(clock):
    timer = StepTimer(warmup=0, clock=clock)
    timer.start()
    for _ in range(3):
        clock.advance(0.5)
        timer.step_done(epoch=0)
    summary = timer.summary(global_batch=4, steps_per_epoch=10, full_epochs=[])
    assert summary["epoch_s"] == pytest.approx(5.0) and summary["epoch_s_estimated"] is True


# checkpoints -------------------------------------------------------------------------------
def _state(step: int, **changes) -> ckpt.TrainerState:
    base = {
        "global_step": step,
        "epoch": 0,
        "step_in_epoch": step,
        "identity": {"config_sha": "a", "num_labels": 10},
        "batch_size": 32,
        "seed": 0,
        "mixed_precision": "no",
        "model": "vit-tiny",
    }
    return ckpt.TrainerState(**{**base, **changes})


def _checkpoint(run: Path, step: int, complete: bool = True) -> Path:
    path = run / ckpt.CHECKPOINTS / ckpt.checkpoint_name(step)
    path.mkdir(parents=True)
    if complete:
        ckpt.write_state(path, _state(step))
    return path


def test_resume_latest_picks_the_newest_complete_checkpoint(tmp_path):
    old, new = tmp_path / "20250101-000000", tmp_path / "20250102-000000"
    _checkpoint(old, 50)
    _checkpoint(new, 10)
    best = _checkpoint(new, 20)
    _checkpoint(new, 30, complete=False)  # killed while saving: ignored
    assert ckpt.resolve_resume("latest", [old, new]) == best
    assert ckpt.resolve_resume(str(new), []) == best  # a run directory: its latest
    assert ckpt.resolve_resume(str(new / "checkpoints"), []) == best
    assert ckpt.resolve_resume(str(best), []) == best
    with pytest.raises(ValueError, match="no complete checkpoint"):
        ckpt.resolve_resume("latest", [tmp_path / "empty"])
    with pytest.raises(ValueError, match="does not exist"):
        ckpt.resolve_resume(str(tmp_path / "nope"), [])
    with pytest.raises(ValueError, match="not a complete accelab checkpoint"):
        ckpt.read_state(new / "checkpoints" / ckpt.checkpoint_name(30))


def test_incompatible_checkpoint_is_a_clear_error_and_changed_settings_a_warning(tmp_path):
    state = _state(10)
    with pytest.raises(ValueError, match=r"written for vit-tiny .*differs in config_sha.*same --model"):
        ckpt.check_compatible(
            state,
            tmp_path,
            identity={"config_sha": "b", "num_labels": 10},
            model="resnet-50",
            batch_size=32,
            seed=0,
            mixed_precision="no",
        )
    warnings = ckpt.check_compatible(
        state, tmp_path, identity=state.identity, model="vit-tiny", batch_size=64, seed=0, mixed_precision="no"
    )
    assert len(warnings) == 1 and "--batch-size 64" in warnings[0]


# threads -----------------------------------------------------------------------------------
def test_threads_follow_the_idle_cpus_shared_among_the_ranks_of_a_node():
    from accelab.train.threads import threads_per_process

    assert threads_per_process(1, None, idle=2.0) == 2  # an idle 2-core machine: torch's default
    assert threads_per_process(1, None, idle=0.6) == 1  # another program holds a core and a half
    assert threads_per_process(2, None, idle=1.9) == 1
    assert threads_per_process(4, None, idle=15.6) == 4
    assert threads_per_process(4, 3, idle=0.2) == 3  # --threads wins


# options -----------------------------------------------------------------------------------
def test_explicit_options_beat_the_plan_which_beats_defaults():
    merged = merge(
        {"batch_size": 8, "lr": None},
        {"batch_size": 64, "mixed_precision": "bf16"},
        {"batch_size": 32, "lr": 1e-3, "mixed_precision": "no"},
    )
    assert merged == {"batch_size": 8, "lr": 1e-3, "mixed_precision": "bf16"}


def test_plan_fields_map_to_training_options(tmp_path):
    settings, notes = plan_settings("bf16-autocast")
    assert settings["mixed_precision"] == "bf16" and settings["compile"] == "off" and not notes
    path = tmp_path / "p.yaml"
    path.write_text(
        "precision: fp16-autocast\ncompile: default\nbatch_size: 64\nthreads: 2\nquantization: int8-weight\n"
    )
    settings, notes = plan_settings(str(path))
    assert settings == {"mixed_precision": "fp16", "compile": "default", "batch_size": 64, "threads": 2}
    assert "quantization" in notes[0]
    with pytest.raises(ValueError, match="cast of the weights for inference"):
        plan_settings("bf16")


def test_default_names_are_valid_store_names():
    assert default_name("digits", "digits", "vit-tiny") == "digits-vit-tiny"
    assert default_name("/data/my flowers/", "imagefolder", "/models/resnet-50/") == "my-flowers-resnet-50"
    assert default_name("", "text", "smollm2-135m") == "smollm2-135m-heldout"
    assert default_name("/x/notes.txt", "text", "smollm2-135m") == "smollm2-135m-notes"


# model fit ---------------------------------------------------------------------------------
VIT = {"model_type": "vit", "image_size": 32, "hidden_size": 192, "id2label": {str(i): str(i) for i in range(10)}}


def test_label_fit_errors_on_a_different_label_count_unless_reinit_head():
    classes = ["cat", "dog", "fish"]
    with pytest.raises(ValueError, match=r"10-label classifier head but the dataset has 3 classes.*--reinit-head"):
        label_fit(VIT, classes, reinit_head=False, model="vit-tiny")
    fit = label_fit(VIT, classes, reinit_head=True, model="vit-tiny")
    assert fit.load_kwargs["num_labels"] == 3 and fit.load_kwargs["ignore_mismatched_sizes"] is True
    assert fit.load_kwargs["id2label"] == {0: "cat", 1: "dog", 2: "fish"} and "re-initialised" in fit.note
    assert label_fit(VIT, [str(i) for i in range(10)], reinit_head=False, model="vit-tiny").load_kwargs == {}


def test_image_size_is_fixed_by_vit_configs_and_free_for_convnets():
    assert image_size_for(VIT, {}, None, "vit-tiny") == 32
    with pytest.raises(ValueError, match="takes 32 px images"):
        image_size_for(VIT, {}, 64, "vit-tiny")
    convnet = {"model_type": "resnet"}
    assert image_size_for(convnet, {"size": {"shortest_edge": 224}}, None, "resnet-50") == 224
    assert image_size_for(convnet, {"size": {"shortest_edge": 224}}, 64, "resnet-50") == 64


def test_processor_is_configured_for_the_training_size():
    class Proc:
        def __init__(self, size, crop=None):
            self.size, self.crop_size = size, crop

    vit = configure_processor(Proc({"height": 224, "width": 224}), 32)
    assert vit.size == {"height": 32, "width": 32}
    convnext = configure_processor(Proc({"shortest_edge": 224}, {"height": 224, "width": 224}), 64)
    assert convnext.size == {"shortest_edge": 64} and convnext.crop_size == {"height": 64, "width": 64}


def test_identity_ignores_label_names_but_not_shapes():
    a = identity(VIT, "image-classification", 10)
    renamed = identity({**VIT, "id2label": {str(i): f"c{i}" for i in range(10)}}, "image-classification", 10)
    wider = identity({**VIT, "hidden_size": 256}, "image-classification", 10)
    assert a == renamed and a != wider
    assert a != identity(VIT, "image-classification", 3)


# precision and bench rows ------------------------------------------------------------------
def test_fp16_is_unsupported_on_cpu_and_bf16_needs_a_capable_gpu():
    assert "silent no-op" in precision_problem("fp16", cuda=False)
    assert precision_problem("fp16", cuda=True) is None
    assert precision_problem("bf16", cuda=False) is None
    assert "no native bf16" in precision_problem("bf16", cuda=True, bf16_on_gpu=False)


def test_bench_rows_on_cpu_and_on_a_one_gpu_machine():
    config = make_config(batch_size=32)
    rows = {r.name: r for r in bench_rows(config, cuda=False, bf16_on_gpu=None, gpus=0, nproc=2, accum=4)}
    assert list(rows) == [
        "baseline (fp32)",
        "bf16 autocast",
        "fp16 autocast",
        "grad accum x4",
        "2 processes",
        "compile",
        "activation checkpointing",
        "loader workers x2",
        "fsdp (2 processes)",
    ]
    assert rows["fp16 autocast"].unsupported and rows["bf16 autocast"].unsupported is None
    assert rows["grad accum x4"].changes == {"grad_accum": 4} and rows["2 processes"].nproc == 2
    gpu = {r.name: r for r in bench_rows(config, cuda=True, bf16_on_gpu=True, gpus=1, nproc=2, accum=4)}
    assert gpu["fp16 autocast"].unsupported is None
    assert "need 2 GPUs; 1 found" in gpu["2 processes"].unsupported
    odd = {
        r.name: r for r in bench_rows(make_config(batch_size=6), cuda=False, bf16_on_gpu=None, gpus=0, nproc=2, accum=4)
    }
    assert "does not split" in odd["grad accum x4"].unsupported


# the loop's bookkeeping, with a fake accelerator (fp16 skipped steps are a GPU path) ---------
def test_after_step_counts_skipped_fp16_steps_and_checkpoints_on_cadence(monkeypatch, clock):
    from types import SimpleNamespace

    import torch

    from accelab.train import loop

    class FakeAccelerator:
        device = torch.device("cpu")
        is_main_process = True

        def __init__(self):
            self._skips = iter([False, True, False, False, False, False])  # GradScaler: inf/nan at step 2
            self.logged = []

        @property
        def optimizer_step_was_skipped(self) -> bool:
            return next(self._skips)

        def reduce(self, tensor, reduction):
            assert reduction == "mean"
            return tensor

        def log(self, values, step):
            self.logged.append((step, values))

    saved = []
    monkeypatch.setattr(loop, "save_checkpoint", lambda session, position: saved.append(position.global_step))
    session = SimpleNamespace(
        config=make_config(checkpoint_every=2, grad_accum=2),
        accelerator=FakeAccelerator(),
        scheduler=SimpleNamespace(get_last_lr=lambda: [0.1]),
        steps_per_epoch=3,
    )
    position, record = loop.Position(), loop.Record(losses=[], lrs=[], evals=[])
    timer = StepTimer(warmup=0, clock=clock)
    timer.start()
    for _ in range(6):
        if position.step_in_epoch == session.steps_per_epoch:  # run_epochs starts the next epoch
            position.epoch, position.step_in_epoch = position.epoch + 1, 0
        clock.advance(1.0)
        loop._after_step(session, position, record, torch.tensor(3.0), timer, NoProgress(False))
    assert record.skipped_steps == 1
    assert record.losses == [1.5] * 6  # summed micro-step losses / grad_accum
    assert saved == [2, 4]  # every 2 steps; step 6 ends epoch 2, where run_epochs checkpoints after eval
    assert [step for step, _ in session.accelerator.logged] == [1, 2, 3, 4, 5, 6]
    assert timer.epochs == [0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("world_size, finalized", [("2", False), ("1", True)])
def test_a_torchrun_rank_exits_without_interpreter_finalization(world_size, finalized):
    """Under torchrun a worker leaves with os._exit after flushing its output, so no destructor of
    torch's C++ threads can abort it after its work is done; a single process exits normally."""
    import os
    import subprocess

    script = (
        "import atexit, sys; from accelab.launch import exit_worker; "
        "atexit.register(lambda: print('finalized', flush=True)); "
        "print('summary written', end=''); sys.stderr.write('a warning'); exit_worker(3)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "WORLD_SIZE": world_size},
        check=False,
    )
    assert done.returncode == 3
    assert done.stdout.startswith("summary written") and done.stderr.endswith("a warning")  # flushed
    assert ("finalized" in done.stdout) is finalized
