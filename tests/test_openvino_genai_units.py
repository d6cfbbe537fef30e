"""backend openvino's text generation (OpenVINO GenAI), the parts that need no engine: its options
and where they apply, the presets, the export cache key, finding the venv, the engine's key and
its KV-block arithmetic."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from accelab.backends import BACKENDS, engine_wire as W, openvino_genai
from accelab.catalog.spec import ModelSpec
from accelab.plan.backend_options import OvOptions, check_options
from accelab.plan.presets import PRESETS
from accelab.plan.runtime import Unsupported

CPU = torch.device("cpu")


def hf_dir(tmp_path: Path) -> ModelSpec:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "model.safetensors").write_bytes(b"0" * 16)
    return ModelSpec(name="tiny", task="text-generation", source=str(tmp_path))


def test_options_are_validated_before_anything_loads():
    options = OvOptions.parse({"ov_weights": "int4", "ov_max_num_seqs": "8", "ov_kv_precision": "u8"})
    assert (options.weights, options.max_num_seqs, options.kv_cache_precision) == ("int4", 8, "u8")
    assert OvOptions.parse({"ov_precision": "bf16"}).kv_cache_precision == "bf16"  # "same" follows the precision
    with pytest.raises(ValueError, match="ov_weights='int2' is not allowed; choose one of: fp32, int8, int4"):
        check_options("openvino", {"ov_weights": "int2"})
    with pytest.raises(ValueError, match="ov_kv_cache_gib='0' must be a whole number of 1 or more"):
        check_options("openvino", {"ov_kv_cache_gib": "0"})
    with pytest.raises(ValueError, match="did you mean 'ov_weights'"):
        check_options("openvino", {"ov_weight": "int8"})


def test_generation_options_on_a_forward_pass_model_are_refused_with_the_reason():
    spec = ModelSpec(name="enc", task="feature-extraction", source="/nowhere")
    plan = PRESETS["openvino-int8"]
    with pytest.raises(Unsupported, match="ov_weights=int8: options of OpenVINO GenAI's text generation"):
        BACKENDS["openvino"].check(spec, plan, CPU)


def test_generation_checks_the_layout_and_the_device(tmp_path):
    gguf_only = ModelSpec(name="g", task="text-generation", source=str(tmp_path))
    with pytest.raises(Unsupported, match="no config.json"):
        BACKENDS["openvino"].check(gguf_only, PRESETS["openvino-int8"], CPU)
    spec = hf_dir(tmp_path)
    with pytest.raises(Unsupported, match="CPU plugin.*--device cpu"):
        BACKENDS["openvino"].check(spec, PRESETS["openvino"], torch.device("cuda"))
    with pytest.raises(Unsupported, match="torch fields precision"):
        BACKENDS["openvino"].check(spec, PRESETS["openvino"].with_changes(precision="bf16-weights"), CPU)


def test_presets_name_the_weight_formats():
    assert PRESETS["openvino-int8"].option == {"ov_weights": "int8"}
    assert PRESETS["openvino-int8-bf16"].option == {"ov_precision": "bf16", "ov_weights": "int8"}
    assert PRESETS["openvino-int4"].option == {"ov_weights": "int4"}


def test_find_genai_follows_the_override_and_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv(openvino_genai.VENV_ENV, str(tmp_path))
    install, reason = openvino_genai.find_genai()
    assert install is None and "make openvino" in reason and str(tmp_path) in reason
    site = tmp_path / "lib" / "python3.11" / "site-packages"
    (site / "openvino_genai-2026.4.1.0.dist-info").mkdir(parents=True)
    (site / "optimum_intel-2.2.0.dist-info").mkdir()
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text("")
    install, where = openvino_genai.find_genai()
    assert install is not None and (install.version, install.exporter) == ("2026.4.1.0", "2.2.0")
    assert openvino_genai.VENV_ENV in where and install.optimum_cli == tmp_path / "bin" / "optimum-cli"


def test_an_export_is_keyed_by_weights_and_by_the_model_files(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELAB_CACHE", str(tmp_path / "cache"))
    (tmp_path / "m").mkdir()
    spec = hf_dir(tmp_path / "m")
    install = openvino_genai.GenAIInstall(python=Path("/v/bin/python"), venv=Path("/v"), version="1", exporter="2")
    int8 = openvino_genai.export_dir(spec, "int8", install)
    assert int8 == openvino_genai.export_dir(spec, "int8", install)
    assert int8 != openvino_genai.export_dir(spec, "int4", install)
    assert int8.parent == tmp_path / "cache" / "openvino-genai" and int8.name.startswith("tiny-int8-")
    (Path(spec.source) / "model.safetensors").write_bytes(b"1" * 32)  # new weights: a new export
    assert openvino_genai.export_dir(spec, "int8", install) != int8


def test_measuring_engines_are_shared_and_a_servers_engine_is_its_own():
    install = openvino_genai.GenAIInstall(python=Path("/v/bin/python"), venv=Path("/v"), version="1", exporter="2")
    config = W.OvEngineConfig(model="/export", keep_s=600)
    kept = openvino_genai.engine_key(config, install)
    assert kept == openvino_genai.engine_key(W.OvEngineConfig(model="/export", keep_s=5), install)  # keep_s aside
    assert kept != openvino_genai.engine_key(W.OvEngineConfig(model="/export", precision="bf16"), install)
    assert openvino_genai.engine_key(config, install, owner=1) != openvino_genai.engine_key(config, install, owner=2)


def test_the_kv_pool_in_blocks_follows_the_cache_precision(tmp_path):
    """SmolLM2-135M's shape: 30 layers, 3 KV heads of 64; a block holds 32 tokens (measured: 100
    f32 blocks are 147,456,000 bytes in OpenVINO's own metrics)."""
    # the engine script imports only the standard library at its top
    spec = importlib.util.spec_from_file_location("ov_engine_under_test", openvino_genai.ENGINE_SCRIPT)
    assert spec is not None and spec.loader is not None
    engine = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(engine)
    config = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    (tmp_path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8192}))
    assert engine.kv_blocks(tmp_path, "f32", 147_456_000) == (100, 8192)
    assert engine.kv_blocks(tmp_path, "bf16", 147_456_000) == (200, 8192)
    u8_blocks, _ = engine.kv_blocks(tmp_path, "u8", 147_456_000)
    assert 350 < u8_blocks < 400  # a byte a value, and a scale and zero point per head


def test_the_servers_batch_size_sizes_the_engine_unless_the_plan_does():
    """`accelab serve --max-batch-size 16` runs up to 16 sequences in the pipeline (OpenVINO's own
    default is 256); ov_max_num_seqs in the plan wins."""
    options = OvOptions.parse({"ov_precision": "bf16", "ov_kv_cache_gib": "2"})
    config = openvino_genai.engine_config(Path("/export"), options, keep_s=0, threads=2, max_num_seqs=16)
    assert (config.max_num_seqs, config.precision, config.kv_precision) == (16, "bf16", "bf16")
    assert (config.kv_cache_bytes, config.threads, config.model) == (2 * 2**30, 2, "/export")
    planned = OvOptions.parse({"ov_max_num_seqs": "4"})
    assert openvino_genai.engine_config(Path("/e"), planned, keep_s=0, threads=None, max_num_seqs=16).max_num_seqs == 4


def test_engine_sockets_live_under_accelab_runtime_dir(tmp_path, monkeypatch):
    """A job keeps its engines to itself with a runtime directory of its own; the system's temporary
    directory is the default, shared by every accelab process of this user."""
    import os
    import tempfile

    from accelab.backends.engine_launch import runtime_dir

    monkeypatch.setenv("ACCELAB_RUNTIME_DIR", str(tmp_path / "not-yet"))
    mine = runtime_dir("openvino")
    assert mine == tmp_path / "not-yet" / f"accelab-openvino-{os.getuid()}" and mine.is_dir()
    assert mine.stat().st_mode & 0o777 == 0o700  # nobody else's process finds these sockets
    monkeypatch.delenv("ACCELAB_RUNTIME_DIR")
    assert runtime_dir("openvino").parent == Path(tempfile.gettempdir()) != mine.parent
