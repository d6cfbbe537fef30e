"""The Python API: the notebook-style example (examples/python_api.py) runs bench, compare,
verify, tune and apply on a model class defined in its own __main__; the tests here check what
each function returned and stored, and the edges: model objects of both kinds, callables, bad
arguments, and apply on a transformers model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import accelab
from accelab import api
from accelab.plan.runtime import Unsupported
from accelab.results.store import Store

ROOT = Path(__file__).resolve().parents[1]
QUICK = {"batch_size": 2, "min_seconds": 0.2, "min_iters": 3, "warmup": 1}


@pytest.mark.slow
def test_the_example_script_runs_every_function_and_stores_its_results(tmp_path: Path):
    db = tmp_path / "results.db"
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "python_api.py")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "ACCELAB_DB": str(db)},
        check=False,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    out = run.stdout
    assert "baseline:" in out and "images/s" in out
    assert "channels-last" in out and "unsupported [" in out  # the sdpa row says why
    assert "verify channels-last: pass (top-1 agreement 1.00)" in out
    assert "tune picked tuned-" in out and (tmp_path / "smallnet-best.yaml").is_file()
    assert "outputs unchanged: True" in out
    kinds = [r.kind for r in Store(db).query(limit=100)]
    assert kinds.count("compare") == 4 and kinds.count("verify") == 1 and kinds.count("bench") == 1
    assert kinds.count("tune") == 4  # two screening runs and the two finals


@pytest.mark.slow
def test_bench_of_a_module_object_is_stored_and_reuses_one_saved_copy(tmp_path: Path):
    from custom_models import TinyConvNet

    db = tmp_path / "results.db"
    torch.manual_seed(0)
    net, example = TinyConvNet(), torch.randn(1, 3, 32, 32)
    first = accelab.bench(net, workload=QUICK, inputs=example, db=db)
    assert first.status == "ok", first.reason
    assert first.metrics["throughput"] > 0 and first.workload["batch_size"] == 2
    assert first.model["builder"].startswith("pickle:") and first.model["name"] == "TinyConvNet"
    assert Store(db).count() == 1
    assert api.model_spec(net, inputs=example).builder == first.model["builder"]  # same bytes: the same file
    assert api.model_spec(net, inputs=example * 2).builder != first.model["builder"]


def test_a_plan_with_a_batch_size_sets_the_workload_unless_the_workload_says(tmp_path: Path):
    from custom_models import TinyConvNet

    from accelab.plan.plan import load_plan

    plan = load_plan("baseline", ["batch_size=3"])
    spec = api.model_spec(TinyConvNet(), inputs=torch.randn(1, 3, 32, 32))
    assert api._workload(spec, {"min_seconds": 0.1}, plan).batch_size == 3
    assert api._workload(spec, {"batch_size": 5}, plan).batch_size == 5
    with pytest.raises(ValueError, match="unknown fields \\['batchsize'\\]"):
        api._workload(spec, {"batchsize": 5}, plan)


def test_model_spec_takes_names_callables_and_objects(monkeypatch: pytest.MonkeyPatch):
    import custom_models

    monkeypatch.chdir(Path(__file__).parent)
    assert api.model_spec("minilm-l6").task == "feature-extraction"
    assert api.model_spec(custom_models.build).builder == "custom_models:build"  # importable: by name

    def build_here():  # defined in a function: not importable by name, so it is pickled
        return custom_models.TinyConvNet()

    by_value = api.model_spec(build_here, inputs=torch.randn(1, 3, 16, 16))
    assert by_value.builder.startswith("pickle:") and by_value.task == "image-classification"
    with pytest.raises(TypeError, match="pass a name, a path, a Hub id, a callable or an nn.Module"):
        api.model_spec(42)
    with pytest.raises(ValueError, match="inputs= and processor= are for model objects"):
        api.model_spec("minilm-l6", inputs=torch.zeros(1))


@pytest.mark.slow
def test_a_transformers_object_is_saved_with_its_processor_and_loads_like_a_directory(tmp_path: Path):
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    from accelab.catalog.resolve import resolve

    source = resolve("vit-tiny").source
    model = AutoModelForImageClassification.from_pretrained(source)
    processor = AutoImageProcessor.from_pretrained(source)
    spec = api.model_spec(model, processor=processor)
    assert spec.task == "image-classification" and not spec.custom
    assert (Path(spec.source) / "config.json").is_file() and (Path(spec.source) / "preprocessor_config.json").is_file()
    assert api.model_spec(model, processor=processor).source == spec.source  # content-addressed
    result = accelab.bench(model, processor=processor, workload=QUICK, store=False)
    assert result.status == "ok", result.reason


def test_apply_accelerates_the_object_in_place_and_says_what_it_did():
    from custom_models import TinyConvNet

    torch.manual_seed(0)
    net = TinyConvNet().eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        before = net(x)
    fast = accelab.apply(net, "channels-last")
    with torch.inference_mode():
        after = fast.model(x)
    assert torch.allclose(before, after, atol=1e-5)
    assert fast.model.features[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert any("channels_last" in note for note in fast.notes)
    fast.close()
    with pytest.raises(Unsupported, match="needs a transformers model"):
        accelab.apply(TinyConvNet(), "sdpa")
    with pytest.raises(Unsupported, match="accelab.apply runs torch plans"):
        accelab.apply(TinyConvNet(), "onnxruntime")
    with pytest.raises(TypeError, match="takes a torch.nn.Module"):
        accelab.apply("minilm-l6", "baseline")


def test_apply_on_a_transformers_model_switches_attention_and_quantizes():
    from transformers import AutoModel

    from accelab.catalog.resolve import resolve

    model = AutoModel.from_pretrained(resolve("minilm-l6").source).eval()
    ids = torch.tensor([[101, 7592, 2088, 102]])
    with torch.inference_mode():
        before = model(input_ids=ids).last_hidden_state
    fast = accelab.apply(model, "eager-attention")
    assert fast.model.config._attn_implementation == "eager"
    with torch.inference_mode():
        assert torch.allclose(fast.model(input_ids=ids).last_hidden_state, before, atol=1e-4)
    quantized = accelab.apply(model, "int8-weight")
    assert any("int8-weight" in note for note in quantized.notes)


def test_the_api_names_are_plain_functions_beside_the_command_packages():
    import accelab.benchmark.engine as engine
    import accelab.tuner.run  # importing the subpackage must not replace accelab.tune

    assert callable(accelab.bench) and callable(accelab.tune)
    assert accelab.bench is api.bench and accelab.tune is api.tune and accelab.compare is api.compare
    assert engine.bench is not accelab.bench
    assert "workload" in str(__import__("inspect").signature(accelab.bench))
