"""`accelab train` end to end on this CPU: real worker processes (torchrun for 2 ranks), a
temporary ACCELAB_CACHE, the catalog's vit-tiny for the learning test and a tiny ViT (built
from config, 2 layers of width 32, 16 px) where only the mechanics matter.

Stated tolerance, 1 vs 2 processes (and vs 4 accumulation micro-steps) at the same global
batch: per-step training loss within 1e-4 relative. Dropout is off and every optimizer step sees
the same samples by construction (one seeded order, split by accelerate); what is left is float
summation order (gradient all-reduce, per-rank reductions, thread count), ~1e-7 per step. It
holds for models without batch-dependent layers: a BatchNorm (ResNet) normalises over each
rank's / micro-step's slice, so such models match only approximately.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from train_fixtures import cli, invoke, private_cache

pytestmark = pytest.mark.slow

DDP_LOSS_RTOL = 1e-4


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A private ACCELAB_CACHE with vit-tiny and a tiny ViT (train_fixtures.py)."""
    with private_cache(tmp_path_factory.mktemp("accelab-cache")) as root:
        yield root


def result_json(path: Path) -> dict:
    return json.loads(path.read_text())


# learning, saving, resolving ---------------------------------------------------------------
def test_short_digits_run_learns_and_saves_a_model_the_catalog_resolves(cache, tmp_path):
    from transformers import AutoImageProcessor

    from accelab.catalog.resolve import resolve
    from accelab.catalog.store import read_meta
    from accelab.results.store import open_store

    out, db = tmp_path / "run.json", tmp_path / "results.db"
    # --threads 1: on this shared 2-core machine one thread per process was ~4x faster than two
    cli(
        "--model",
        "vit-tiny",
        "--dataset",
        "digits",
        "--max-steps",
        "270",  # three epochs: after two, one AVX2 EPYC's kernels had 0.49 (others > 0.5), after three 0.73
        "--batch-size",
        "16",
        "--threads",
        "1",
        "--save-as",
        "digits-vit-test",
        "--json",
        str(out),
        "--db",
        str(db),
        "--log-with",
        "tensorboard",
        "--output-dir",
        str(tmp_path / "run"),
    )
    metrics = result_json(out)["metrics"]
    losses = metrics["losses"]
    assert len(losses) == 270
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 0.5  # the loss goes down
    assert metrics["final_accuracy"] > 0.5  # well above chance (10 %) after three epochs
    assert metrics["evals"][-1]["samples"] == 360  # the whole digits test split, each sample once

    spec = resolve("digits-vit-test")
    meta = read_meta(Path(spec.source))
    assert spec.task == "image-classification" and meta["dataset"] == "digits" and meta["image_size"] == 32
    assert meta["metrics"]["test_accuracy"] == pytest.approx(metrics["final_accuracy"])
    processor = AutoImageProcessor.from_pretrained(spec.source, backend="pil")
    from accelab.catalog import inputs

    images, _ = inputs.digits("test", image_size=8)  # any size in: the saved processor resizes to 32
    assert processor(images=images[:2], return_tensors="pt")["pixel_values"].shape == (2, 3, 32, 32)

    stored = open_store(db).query(kind="train")
    assert len(stored) == 1 and stored[0].metrics["final_accuracy"] == metrics["final_accuracy"]
    assert list((tmp_path / "run" / "tensorboard").rglob("events.out.tfevents.*"))  # the tracker wrote


# checkpoint / resume ------------------------------------------------------------------------
def test_resume_from_a_checkpoint_ends_with_the_same_weights(cache, tmp_path):
    from safetensors.torch import load_file

    tiny = str(cache / "tiny-vit")
    # 128 per step: 11 steps per epoch; the checkpoint at 7 is mid-epoch and the resumed run
    # crosses the epoch end (eval, epoch checkpoint, a new epoch's order) before step 14.
    common = [
        "--model",
        tiny,
        "--dataset",
        "digits",
        "--max-steps",
        "14",
        "--batch-size",
        "128",
        "--threads",
        "1",
        "--no-save",
        "--no-store",
    ]
    cli(*common, "--checkpoint-every", "7", "--output-dir", str(tmp_path / "full"))
    checkpoint = tmp_path / "full" / "checkpoints" / "step-0000007"
    assert (checkpoint / "trainer_state.json").is_file()
    assert (tmp_path / "full" / "checkpoints" / "step-0000011").is_dir()  # the epoch-end checkpoint
    cli(
        *common,
        "--resume",
        str(checkpoint),
        "--output-dir",
        str(tmp_path / "resumed"),
        "--json",
        str(tmp_path / "resumed.json"),
    )
    assert result_json(tmp_path / "resumed.json")["metrics"]["steps"] == 14
    full = load_file(tmp_path / "full" / "model" / "model.safetensors")
    resumed = load_file(tmp_path / "resumed" / "model" / "model.safetensors")
    assert full.keys() == resumed.keys()
    for name in full:
        torch.testing.assert_close(resumed[name], full[name], rtol=0, atol=1e-6, msg=name)


def test_resume_from_another_models_checkpoint_is_a_clear_error(cache, tmp_path):
    run = tmp_path / "full"
    ckpt_dir = run / "checkpoints" / "step-0000004"
    ckpt_dir.mkdir(parents=True)
    (ckpt_dir / "trainer_state.json").write_text(
        json.dumps(
            {
                "global_step": 4,
                "epoch": 0,
                "step_in_epoch": 4,
                "batch_size": 16,
                "seed": 0,
                "mixed_precision": "no",
                "model": "vit-tiny",
                "identity": {
                    "model_type": "vit",
                    "task": "image-classification",
                    "num_labels": 10,
                    "config_sha": "0123456789abcdef",
                },
            }
        )
    )
    result = invoke("--model", str(cache / "tiny-vit"), "--resume", str(ckpt_dir), "--no-store")
    assert isinstance(result.exception, ValueError)
    assert "was written for vit-tiny" in str(result.exception) and "same --model" in str(result.exception)


# bench ---------------------------------------------------------------------------------------
@pytest.mark.alone  # two processes against one: a second test worker would take the second core
def test_bench_rows_and_one_vs_two_processes(cache, tmp_path):
    """The bench's rows are separate worker runs on the same data order: the 2-process row
    (two torchrun ranks) and the accumulation row must follow the baseline's loss curve."""
    from accelab.results.store import open_store

    out, db = tmp_path / "bench.json", tmp_path / "results.db"
    result = cli(
        "--bench",
        "--model",
        str(cache / "tiny-vit"),
        "--dataset",
        "digits",
        "--max-steps",
        "5",
        "--bench-warmup",
        "1",
        "--batch-size",
        "16",
        "--threads",
        "1",
        "--json",
        str(out),
        "--db",
        str(db),
        "--output-dir",
        str(tmp_path / "bench"),
        "--bench-rows",
        "bf16,fp16,accum,ddp",  # the baseline always runs; compile, checkpointing, workers: the next test
    )
    doc = result_json(out)
    rows = {row["configuration"]: row for row in doc["rows"]}
    full = {r["plan"]["name"]: r for r in doc["results"]}
    assert list(rows) == ["baseline (fp32)", "bf16 autocast", "fp16 autocast", "grad accum x4", "2 processes"]
    assert rows["fp16 autocast"]["status"] == "unsupported" and "needs a GPU" in rows["fp16 autocast"]["reason"]
    for name in ("baseline (fp32)", "bf16 autocast", "grad accum x4", "2 processes"):
        row = rows[name]
        assert row["status"] == "ok", row
        assert row["timed_samples"] == 4 * 16  # 5 steps, the first one left out
        assert row["samples_per_s"] == pytest.approx(row["timed_samples"] / row["timed_wall_s"])
        assert row["final_accuracy"] is not None and row["peak_rss_mb_max"] > 0
    assert rows["grad accum x4"]["grad_accum"] == 4 and rows["grad accum x4"]["global_batch"] == 16
    assert (
        rows["2 processes"]["nproc"] == 2
        and rows["2 processes"]["peak_rss_mb_sum"] > rows["2 processes"]["peak_rss_mb_max"]
    )
    assert "unsupported" in result.output and "samples/s" in result.output  # the printed table

    baseline, two = full["baseline (fp32)"]["metrics"], full["2 processes"]["metrics"]
    assert full["2 processes"]["workload"]["per_process_batch"] == 8
    assert len(two["peak_rss_mb_per_rank"]) == 2  # two real ranks reported
    assert two["losses"] == pytest.approx(baseline["losses"], rel=DDP_LOSS_RTOL)
    # DDP's all-reduce timed by its comm hook, beside backward; one process has none to time
    assert two["step_split"]["comm"] == "ddp" and 0 < two["step_split"]["communication"]["p50_ms"]
    assert baseline["step_split"]["comm"] == "none" and baseline["step_split"]["communication"] is None
    assert full["grad accum x4"]["metrics"]["losses"] == pytest.approx(baseline["losses"], rel=DDP_LOSS_RTOL)
    assert baseline["losses"][-1] < baseline["losses"][0]
    # eval gathered from both ranks: every test sample exactly once, same accuracy
    assert two["evals"][-1]["samples"] == baseline["evals"][-1]["samples"] == 360
    assert two["final_accuracy"] == pytest.approx(baseline["final_accuracy"], abs=1 / 360)
    stored = open_store(db).query(kind="train")
    assert len(stored) == 5 and len({r.group_id for r in stored}) == 1
    # the rows took turns: each has its rounds and their noise, the others a paired speed-up
    for name in ("baseline (fp32)", "bf16 autocast", "grad accum x4", "2 processes"):
        metrics = full[name]["metrics"]
        assert 1 <= len(metrics["rounds"]) <= 4 and metrics["noise"]["rounds"] == len(metrics["rounds"])
        assert sum(r["calls"] for r in metrics["rounds"]) == 4  # every timed step ran in some turn
    for name in ("bf16 autocast", "grad accum x4", "2 processes"):
        speedup = full[name]["metrics"]["speedup"]
        assert speedup["reference"] == "baseline (fp32)" and speedup["verdict"] in (
            "faster",
            "slower",
            "no measurable difference",
            "unreliable",
        )


# Stated tolerance: a row's step split and its StepTimer read the same clock at the same step
# boundaries, so its phases add up to the timed steps' wall time up to float rounding (1e-9 relative).
SPLIT_RTOL = 1e-9


@pytest.mark.alone  # four rows, their workers and loader processes: the second core is theirs
def test_bench_rows_compile_checkpointing_workers_split_the_step_and_report_mfu(cache, tmp_path):
    """Compile, activation checkpointing, loader workers and FSDP are rows of their own; checkpointing
    and workers do the baseline's math on its data order (same loss curve); every row splits its
    steps into phases that add up to them, and reports an MFU within (0, 100%]."""
    out = tmp_path / "bench.json"
    result = cli(
        "--bench",
        "--model",
        str(cache / "tiny-vit"),
        "--dataset",
        "digits",
        "--max-steps",
        "4",
        "--bench-warmup",
        "1",
        "--batch-size",
        "16",
        "--threads",
        "1",
        "--json",
        str(out),
        "--no-store",
        "--output-dir",
        str(tmp_path / "bench"),
        "--bench-rows",
        "checkpointing,workers,compile,fsdp",
    )
    doc = result_json(out)
    rows = {row["configuration"]: row for row in doc["rows"]}
    full = {r["plan"]["name"]: r["metrics"] for r in doc["results"]}
    assert list(rows) == [
        "baseline (fp32)",
        "compile",
        "activation checkpointing",
        "loader workers x2",
        "fsdp (2 processes)",
    ]
    assert all(row["status"] == "ok" for row in rows.values()), rows
    baseline = full["baseline (fp32)"]
    for name in ("activation checkpointing", "loader workers x2"):  # the same math in the same order
        assert full[name]["losses"] == pytest.approx(baseline["losses"], rel=1e-6)
    assert full["compile"]["losses"] == pytest.approx(baseline["losses"], rel=1e-4)  # fused kernels round otherwise
    assert full["fsdp (2 processes)"]["losses"] == pytest.approx(baseline["losses"], rel=1e-4)  # DDP's tolerance
    assert full["fsdp (2 processes)"]["state_mb_max"] < 0.6 * baseline["state_mb_max"]  # half the state per rank
    assert full["compile"]["warmup_s"] > baseline["warmup_s"]  # its first step compiled
    for name, metrics in full.items():
        split = metrics["step_split"]
        assert split["steps"] == 3 and split["total_s"] == pytest.approx(metrics["timed_wall_s"], rel=SPLIT_RTOL)
        phases = split["phases"]
        assert sum(p["share"] for p in phases.values()) == pytest.approx(1.0)
        assert min(phases[p]["p50_ms"] for p in ("data", "forward", "backward", "optimizer")) > 0, name
        assert phases["other"]["share"] < 0.5, name  # the loop's bookkeeping, not a phase left unmarked
        assert split["forward_flops_per_sample"] == baseline["step_split"]["forward_flops_per_sample"] > 0
        assert 0 < rows[name]["mfu"] <= 1 and rows[name]["step_split"]["forward"] == phases["forward"]["share"]
    assert "MFU" in result.output and "fwd" in result.output  # the printed table


# other data sources ----------------------------------------------------------------------------
def _digit_folder(root: Path, classes: tuple[int, ...] = (0, 1, 7), per_class: int = 24) -> Path:
    from accelab.catalog import inputs

    images, labels = inputs.digits("all", image_size=16)
    for cls in classes:
        (root / f"digit{cls}").mkdir(parents=True)
        chosen = [im for im, y in zip(images, labels) if y == cls][:per_class]
        for i, image in enumerate(chosen):
            image.save(root / f"digit{cls}" / f"{i}.png")
    (root / f"digit{classes[0]}" / "broken.png").write_bytes(b"not a png")
    return root


def test_imagefolder_with_an_unreadable_file_and_a_new_head(cache, tmp_path, caplog):
    folder = _digit_folder(tmp_path / "folder")
    common = [
        "--model",
        str(cache / "tiny-vit"),
        "--dataset",
        str(folder),
        "--max-steps",
        "3",
        "--batch-size",
        "8",
        "--threads",
        "1",
        "--no-store",
    ]
    mismatch = invoke(*common)
    assert isinstance(mismatch.exception, ValueError) and "--reinit-head" in str(mismatch.exception)
    out = tmp_path / "r.json"
    # two ranks: the 15 eval images end in a batch of 7 that accelerate pads to split it evenly;
    # gather_for_metrics must drop the padding
    cli(*common, "--reinit-head", "--nproc", "2", "--save-as", "folder-vit", "--json", str(out))
    doc = result_json(out)
    assert doc["status"] == "ok" and doc["workload"]["world_size"] == 2
    assert doc["metrics"]["evals"][-1]["samples"] == 15  # 20 % of 3 x 24 (one per class each), each once
    assert any("re-initialised: 10 -> 3 labels" in note for note in doc["notes"])
    from accelab.catalog.resolve import resolve
    from accelab.train.model import read_model_config

    config = read_model_config(resolve("folder-vit").source)
    assert config["id2label"] == {"0": "digit0", "1": "digit1", "2": "digit7"}


def test_imagefolder_builder_counts_and_names_unreadable_images(cache, tmp_path, caplog):
    from accelab.catalog.build_vision import image_processor_class
    from accelab.train.config import TrainConfig
    from accelab.train.data_images import build_folder

    folder = _digit_folder(tmp_path / "folder", per_class=5)
    processor = image_processor_class("ViTImageProcessor")(size={"height": 16, "width": 16})
    config = TrainConfig(
        model="m", model_source="/m", output_dir="/o", dataset=str(folder), dataset_kind="imagefolder", batch_size=4
    )
    with caplog.at_level(logging.WARNING):
        data = build_folder(config, processor, 16)
    assert data.skipped == 1 and "broken.png" in caplog.text
    assert len(data.train) + len(data.eval) == 15 and data.train[0]["pixel_values"].shape == (3, 16, 16)


def test_saved_datasets_dataset_with_autodetected_columns(cache, tmp_path):
    import datasets

    from accelab.catalog import inputs
    from accelab.catalog.build_vision import image_processor_class
    from accelab.train.config import TrainConfig
    from accelab.train.data import class_names, detect_kind
    from accelab.train.data_images import build_disk

    images, labels = inputs.digits("all", image_size=16)
    features = datasets.Features(
        {"img": datasets.Image(), "digit": datasets.ClassLabel(names=[str(i) for i in range(10)])}
    )
    ds = datasets.Dataset.from_dict({"img": images[:60], "digit": labels[:60]}, features=features)
    datasets.DatasetDict({"train": ds.select(range(50)), "test": ds.select(range(50, 60))}).save_to_disk(
        tmp_path / "ds"
    )
    assert detect_kind(str(tmp_path / "ds"), "image-classification") == "disk"
    config = TrainConfig(
        model="m", model_source="/m", output_dir="/o", dataset=str(tmp_path / "ds"), dataset_kind="disk", batch_size=4
    )
    assert class_names(config) == [str(i) for i in range(10)]
    processor = image_processor_class("ViTImageProcessor")(size={"height": 16, "width": 16})
    data = build_disk(config, processor, 16)
    assert len(data.train) == 50 and len(data.eval) == 10 and data.eval_split == "the dataset's eval split"
    with pytest.raises(ValueError, match="--label-column"):
        class_names(config.with_changes(label_column="nope"))


def test_causal_lm_fine_tuning_reports_perplexity(cache, tmp_path):
    tokenizer_dir = Path.home() / ".cache" / "accelab" / "models" / "smollm2-135m"
    if not (tokenizer_dir / "tokenizer.json").is_file():
        pytest.skip("needs the smollm2-135m tokenizer (accelab models fetch smollm2-135m)")
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tiny = tmp_path / "tiny-llama"
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(tiny)
    tokenizer.save_pretrained(tiny)
    # like the catalog's smollm2-135m (dequantised from a GGUF): a stale GGUF marker in config.json
    config_json = json.loads((tiny / "config.json").read_text())
    config_json["quantization_config"] = {"quant_method": "gguf", "gguf_file": "m.gguf", "dequantize": False}
    (tiny / "config.json").write_text(json.dumps(config_json))
    corpus = tmp_path / "corpus.txt"
    from accelab.catalog import inputs

    corpus.write_text(inputs.heldout_text())
    out = tmp_path / "lm.json"
    cli(
        "--model",
        str(tiny),
        "--dataset",
        str(corpus),
        "--max-steps",
        "4",
        "--batch-size",
        "4",
        "--block-size",
        "64",
        "--lr",
        "3e-3",
        "--warmup-steps",
        "0",
        "--threads",
        "1",
        "--gradient-checkpointing",
        "--save-as",
        "tiny-llama-ft",
        "--json",
        str(out),
        "--no-store",
    )
    metrics = result_json(out)["metrics"]
    assert metrics["losses"][-1] < metrics["losses"][0]
    assert 1 < metrics["final_perplexity"] < len(tokenizer)
    from accelab.catalog.resolve import resolve
    from accelab.catalog.store import read_meta

    meta = read_meta(Path(resolve("tiny-llama-ft").source))
    assert meta["task"] == "text-generation" and meta["metrics"]["eval_perplexity"] == pytest.approx(
        metrics["final_perplexity"]
    )


# parent-side errors: no worker starts ---------------------------------------------------------
@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--dataset", "/no/such/dir"], "does not exist"),
        (["--mixed-precision", "fp16"], "fp16 mixed precision needs a GPU"),
        (["--batch-size", "30", "--nproc", "4"], "must be divisible by processes x grad-accum"),
        (["--image-size", "64"], "takes 16 px images"),
        (["--plan", "bf16", "--batch-size", "8"], "cast of the weights for inference"),
        (["--resume", "latest"], "no complete checkpoint"),
    ],
)
def test_bad_input_fails_before_training_with_the_fix(cache, tmp_path, args, fragment):
    result = invoke("--model", str(cache / "tiny-vit"), *args, "--no-store", "--output-dir", str(tmp_path / "o"))
    assert isinstance(result.exception, ValueError), result.output
    assert fragment in str(result.exception)
    assert not (tmp_path / "o" / "train_config.json").exists()  # no worker was started


def test_gradient_checkpointing_on_a_model_without_it_is_a_clear_error(cache, tmp_path):
    from transformers import ResNetConfig, ResNetForImageClassification

    from accelab.catalog.build_vision import image_processor_class

    path = tmp_path / "tiny-resnet"
    ResNetForImageClassification(
        ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=10)
    ).save_pretrained(path)
    image_processor_class("ConvNextImageProcessor")(size={"shortest_edge": 32}).save_pretrained(path)
    result = invoke("--model", str(path), "--gradient-checkpointing", "--no-store")
    assert isinstance(result.exception, ValueError)
    assert "does not support gradient checkpointing" in str(result.exception)
    shutil.rmtree(path)
