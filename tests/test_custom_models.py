"""Custom models (a plain nn.Module from the user's code) through the real CLI: compare, verify,
tune, bench and predict of `custom_models:build` (a small convnet defined in
tests/custom_models.py), run from the tests directory as a user runs accelab beside their
package, and served over HTTP. Techniques that need a transformers model are rows that say so;
bad builders are clear errors (exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from accelab.catalog import custom
from accelab.catalog.custom_inputs import Call, CustomInputs
from accelab.catalog.custom_module import CustomModule
from accelab.catalog.resolve import resolve

TESTS = Path(__file__).parent
ACCELAB = str(Path(sys.executable).parent / "accelab")
QUICK = ["--min-seconds", "0.3", "--min-iters", "3", "--warmup", "1"]


def accelab(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [ACCELAB, *args],
        cwd=TESTS,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        check=False,
    )


@pytest.fixture()
def db(tmp_path: Path) -> str:
    return str(tmp_path / "results.db")


@pytest.mark.slow
def test_compare_runs_the_custom_convnet_and_says_what_needs_transformers(tmp_path: Path, db: str):
    out = tmp_path / "compare.json"
    run = accelab(
        "compare",
        "custom_models:build",
        "--plans",
        "baseline,channels-last,bf16,sdpa,onnxruntime",
        "--batch-size",
        "4",
        *QUICK,
        "--db",
        db,
        "--json",
        str(out),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    results = {r["plan"]["name"]: r for r in json.loads(out.read_text())["results"]}
    for name in ("baseline", "channels-last", "bf16", "onnxruntime"):
        assert results[name]["status"] == "ok", results[name].get("reason")
        assert results[name]["metrics"]["throughput"] > 0
        assert results[name]["workload"]["batch_size"] == 4
    assert results["baseline"]["quality"]["verdict"] == "pass"
    assert results["baseline"]["quality"]["metrics"]["top1_agreement"] == 1.0
    assert results["channels-last"]["quality"]["verdict"] == "pass"
    assert any("channels_last weights (3 conv layers)" in n for n in results["channels-last"]["notes"])
    # bf16 weights: the inputs are cast to the weights' dtype, the logits checked against fp32
    # (they differ, so bf16 really ran, and only by bf16's rounding: 0.3% measured here)
    bf16 = results["bf16"]["quality"]["metrics"]
    assert 0 < bf16["logit_rel_error"] < 0.05 and bf16["top1_agreement"] >= 0.75
    # the ONNX export of the custom module: same outputs (the graph runs the photos too)
    assert results["onnxruntime"]["quality"]["verdict"] == "pass"
    assert results["onnxruntime"]["quality"]["metrics"]["top1_agreement"] == 1.0
    reason = results["sdpa"]["reason"]
    assert results["sdpa"]["status"] == "unsupported"
    assert "attention=sdpa" in reason and "needs a transformers model" in reason and "custom nn.Module" in reason
    assert results["baseline"]["model"]["builder"] == "custom_models:build"
    assert results["baseline"]["model"]["task"] == "image-classification"


@pytest.mark.slow
def test_verify_passes_a_sound_plan_and_fails_a_corrupted_one():
    # --batch-size 4 and the default 128 images: the quality config of the compare above, so its cached
    # reference serves (128 agreeing images show top-1 >= 0.97: fewer could not pass)
    run = accelab("verify", "custom_models:build", "--plan", "channels-last", "--batch-size", "4", "--no-store")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "pass" in run.stdout
    faults = str(TESTS / "faults")
    env = {
        "ACCELAB_TEST_FAULT": "perturb-weights:0.5",
        "PYTHONPATH": os.pathsep.join(filter(None, [faults, os.environ.get("PYTHONPATH")])),
    }
    broken = accelab(
        "verify",
        "custom_models:build",
        "--plan",
        "channels-last",
        "--batch-size",
        "4",
        "--no-store",
        "--json",
        "/dev/stdout",
        env=env,
    )
    assert broken.returncode == 1, broken.stderr[-3000:]
    assert "fail" in broken.stdout and "FAULT INJECTED" in broken.stdout


@pytest.mark.slow
def test_tune_writes_a_plan_that_bench_then_runs(tmp_path: Path, db: str):
    out = tmp_path / "best.yaml"
    run = accelab(
        "tune",
        "custom_models:build",
        "--include",
        "baseline,channels-last",
        "--max-batch",
        "4",
        "--min-seconds",
        "0.3",
        "--out",
        str(out),
        "--db",
        db,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    text = out.read_text()
    assert "reproduce: accelab bench custom_models:build" in text
    assert "batch_size:" in text
    bench = accelab(
        "bench", "custom_models:build", "--plan", str(out), *QUICK, "--db", db, "--json", str(tmp_path / "bench.json")
    )
    assert bench.returncode == 0, bench.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["status"] == "ok" and result["plan"]["name"].startswith("tuned-")
    assert result["workload"]["batch_size"] == result["plan"]["batch_size"]


@pytest.mark.slow
def test_an_encoder_with_keyword_inputs_runs_as_feature_extraction(tmp_path: Path):
    out = tmp_path / "bench.json"
    run = accelab("bench", "custom_models:build_encoder", "--batch-size", "3", *QUICK, "--no-store", "--json", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["model"]["task"] == "feature-extraction"
    assert result["metrics"]["items_per_call"] == 3


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("no_such_package.models:build", "cannot import 'no_such_package.models'"),
        ("custom_models:missing", "custom_models has no 'missing'"),
        ("custom_models:build_nothing", "returned a str; return a torch.nn.Module"),
    ],
)
def test_a_bad_builder_is_a_clear_error(target: str, message: str):
    run = accelab("bench", target, "--no-store")
    assert run.returncode == 2
    assert message in run.stderr and "Traceback" not in run.stderr


def test_a_custom_model_cannot_claim_a_generation_task():
    run = accelab("bench", "custom_models:build", "--task", "text-generation", "--no-store")
    assert run.returncode == 2
    assert "generation needs a transformers model with generate()" in run.stderr


# -- the pieces, in this process --------------------------------------------------------------------
def test_every_process_builds_the_same_random_weights(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(TESTS)
    first = custom.build("custom_models:build_bare", str(TESTS)).model.state_dict()
    torch.manual_seed(123)  # whatever the caller's RNG state
    second = custom.build("custom_models:build_bare", str(TESTS)).model.state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_resolve_infers_the_task_from_the_inputs(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(TESTS)
    assert resolve("custom_models:build_bare").task == "image-classification"  # no inputs: [B, 3, 224, 224]
    assert resolve("custom_models:build_encoder").task == "feature-extraction"  # token ids
    spec = resolve("custom_models:build")
    assert spec.custom and spec.source == str(TESTS)


def test_inputs_are_photos_at_the_example_size_or_seeded_rows():
    images = CustomInputs.from_example(torch.randn(1, 3, 32, 32), "image-classification")
    batch = images.batch(5)
    assert list(batch) == ["pixel_values"] and batch["pixel_values"].shape == (5, 3, 32, 32)
    assert not torch.equal(batch["pixel_values"][0], batch["pixel_values"][1])  # different photos
    assert images.batch(2, image_size=48)["pixel_values"].shape == (2, 3, 48, 48)
    ids = torch.tensor([[1, 7, 3]])
    rows = CustomInputs.from_example({"ids": ids, "mask": torch.ones_like(ids)}, "feature-extraction")
    first, again = rows.random_rows(4), rows.random_rows(4)
    assert first["ids"].shape == (4, 3) and int(first["ids"].max()) <= 7
    assert torch.equal(first["ids"], again["ids"])  # seeded: the reference and the plan see the same rows
    with pytest.raises(ValueError, match="one float tensor"):
        CustomInputs.from_example({"ids": ids}, "image-classification")


def test_the_module_behind_accelabs_call_shape_casts_inputs_and_returns_logits():
    from custom_models import TinyConvNet

    net = TinyConvNet().eval()
    wrapped = CustomModule(net.to(torch.bfloat16), Call(keys=("pixel_values",)), "image-classification")
    out = wrapped(pixel_values=torch.randn(2, 3, 32, 32))  # fp32 in, bf16 weights
    assert out.logits.shape == (2, 10) and out.logits.dtype == torch.bfloat16


def test_predict_classifies_a_folder_of_photos_with_the_custom_model(tmp_path: Path):
    from accelab.catalog import samples

    folder = tmp_path / "photos"
    folder.mkdir()
    for i, image in enumerate(samples.photos(5)):
        image.save(folder / f"{i}.png")
    out = tmp_path / "predictions.jsonl"
    run = accelab(
        "predict", "custom_models:build", "--inputs", str(folder), "--out", str(out), "--top-k", "2", "--no-store"
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"{i}.png" for i in range(5)]
    assert all(len(r["predictions"]) == 2 and 0 < r["predictions"][0]["score"] <= 1 for r in rows)


def test_serve_classifies_an_image_with_the_custom_model(monkeypatch: pytest.MonkeyPatch):
    import base64
    import io

    import httpx
    from serving import running_server

    from accelab.catalog import samples
    from accelab.plan.plan import load_plan
    from accelab.serve.app import create_app
    from accelab.serve.config import ServeConfig
    from accelab.serve.server import engine_factory

    monkeypatch.chdir(TESTS)
    spec = resolve("custom_models:build")
    factory = engine_factory(spec, load_plan("channels-last"), torch.device("cpu"), name=spec.name)
    buffer = io.BytesIO()
    samples.photos(1)[0].save(buffer, format="PNG")
    with running_server(create_app(ServeConfig(model_name=spec.name), factory)) as url:
        response = httpx.post(
            f"{url}/v1/classify", json={"image": base64.b64encode(buffer.getvalue()).decode(), "top_k": 3}, timeout=60
        )
    assert response.status_code == 200, response.text
    labels = response.json()["data"][0]["labels"]
    assert len(labels) == 3 and labels[0]["score"] >= labels[1]["score"] >= labels[2]["score"]


def test_train_says_it_trains_transformers_checkpoints_only():
    run = accelab("train", "--model", "custom_models:build")
    assert run.returncode == 2
    assert "custom nn.Module; accelab train fine-tunes transformers checkpoints" in run.stderr


def test_the_spec_follows_the_weights_a_builder_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A retrained checkpoint behind the same builder is another model: its spec (and so its cached
    fp32 reference and ONNX export) changes with the weights, not only with the module file."""
    (tmp_path / "ckpt_models.py").write_text(
        "import torch\nfrom custom_models import TinyConvNet\n\n"
        "def build():\n    net = TinyConvNet()\n    net.load_state_dict(torch.load('net.pt'))\n    return net\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(TESTS))
    from custom_models import TinyConvNet

    torch.save(TinyConvNet().state_dict(), tmp_path / "net.pt")
    first = resolve("ckpt_models:build")
    assert resolve("ckpt_models:build") == first
    torch.save(TinyConvNet().state_dict(), tmp_path / "net.pt")  # other random weights, same module file
    assert resolve("ckpt_models:build").origin != first.origin
