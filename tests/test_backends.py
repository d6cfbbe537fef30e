"""Alternative runtimes (ONNX Runtime, OpenVINO, llama.cpp): export cache, Unsupported rows with
their reasons, outputs against torch, llama.cpp decoding and its step timing, bad inputs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from caches import with_limits

from accelab.backends import export, is_installed, load_backend
from accelab.catalog.spec import ModelSpec
from accelab.plan.backend_options import LlamaOptions, OrtOptions, OvOptions
from accelab.plan.plan import Plan
from accelab.plan.presets import PRESETS
from accelab.plan.runtime import Unsupported
from accelab.runtimes import check_supported, load_runnable

CPU = torch.device("cpu")
BACKEND_PRESETS = ["onnxruntime", "onnxruntime-fused", "openvino", "llamacpp"]


def catalog_spec(name: str) -> ModelSpec:
    from accelab.catalog.resolve import resolve

    return resolve(name, fetch=False)


def backend_plan(backend: str, **options: str) -> Plan:
    return Plan(name=f"{backend}-test", backend=backend, backend_options=tuple(sorted(options.items())))


# -- pure logic ------------------------------------------------------------------------------------
def test_options_parse_and_reject_with_the_allowed_set():
    assert OrtOptions.parse({"ort_fusion": "on", "ort_quant": "int8-dynamic"}).quant == "int8-dynamic"
    assert OvOptions.parse({}).precision == "f32"  # never OpenVINO's own bf16 default
    assert LlamaOptions.parse({"llama_threads": "2", "n_ctx": "1024"}).threads == 2
    with pytest.raises(ValueError, match="ort_fuson.*did you mean .ort_fusion"):
        OrtOptions.parse({"ort_fuson": "on"})
    with pytest.raises(ValueError, match="choose one of: none, int8-dynamic"):
        OrtOptions.parse({"ort_quant": "int4"})
    with pytest.raises(ValueError, match="is an option of backend=onnxruntime.*runs backend=openvino"):
        OvOptions.parse({"ort_fusion": "on"})
    with pytest.raises(ValueError, match="not an option of backend=openvino.*its options are: ov_precision"):
        OvOptions.parse({"ov_precison": "f32"})
    with pytest.raises(ValueError, match="whole number"):
        LlamaOptions.parse({"n_ctx": "big"})
    with pytest.raises(ValueError, match="needs|only ort_fusion='on'"):
        OrtOptions.parse({"ort_quant": "int8-dynamic", "ort_quant_ops": "attention"})


def test_execution_provider_and_bf16_need_what_they_need():
    from accelab.backends.onnxruntime import execution_provider
    from accelab.backends.openvino import check_precision

    cpu_only = ["CPUExecutionProvider"]
    assert execution_provider(OrtOptions(), CPU, cpu_only) == "CPUExecutionProvider"
    assert execution_provider(OrtOptions(provider="cpu"), torch.device("cuda"), cpu_only) == "CPUExecutionProvider"
    assert execution_provider(OrtOptions(), torch.device("cuda"), [*cpu_only, "CUDAExecutionProvider"]) == (
        "CUDAExecutionProvider"
    )
    with pytest.raises(Unsupported, match="pip install onnxruntime-gpu"):
        execution_provider(OrtOptions(), torch.device("cuda"), cpu_only)
    check_precision(OvOptions(precision="bf16"), ["FP32", "BF16"])
    with pytest.raises(Unsupported, match="native bf16"):
        check_precision(OvOptions(precision="bf16"), ["FP32", "INT8"])


def test_failed_export_names_the_model_and_the_operator(tmp_path):
    class Lgamma(torch.nn.Module):  # aten::lgamma has no ONNX conversion in the legacy exporter
        def forward(self, x):
            return torch.lgamma(x)

    with pytest.raises(export.ExportFailed) as info:
        export.export_module(
            Lgamma(), {"x": torch.rand(2, 3)}, tmp_path / "m.onnx", output_name="y", axes={}, model_name="toy-model"
        )
    message = str(info.value)
    assert "toy-model" in message and "'aten::lgamma'" in message and "backend=torch" in message
    assert isinstance(info.value, Unsupported)  # a compare row, not a crash
    assert export.failed_operator("Unsupported: ONNX export of operator foo::bar, ...") == "foo::bar"
    assert export.failed_operator("something else went wrong") is None


def test_technique_checks_accept_backend_presets():
    from accelab.plan.apply import check_techniques

    spec = catalog_spec("minilm-l6")
    for name in BACKEND_PRESETS:
        check_techniques(PRESETS[name], spec, CPU)  # the torch techniques raise nothing


def test_check_supported_asks_the_runtime_too_before_anything_loads():
    spec = catalog_spec("minilm-l6")
    check_supported(PRESETS["onnxruntime"], spec, CPU)  # a graph runtime for an encoder: fine
    with pytest.raises(Unsupported, match="llama.cpp runs text-generation models from GGUF files"):
        check_supported(PRESETS["llamacpp"], spec, CPU)
    with pytest.raises(Unsupported, match="torch fields compile"):
        check_supported(backend_plan("onnxruntime").with_changes(compile="default"), spec, CPU)


def test_torch_only_fields_are_refused_with_the_reason():
    plan = backend_plan("onnxruntime").with_changes(compile="default")
    with pytest.raises(Unsupported, match="torch fields compile"):
        load_backend(catalog_spec("minilm-l6"), plan, CPU)


# -- a missing backend is a reasoned row ---------------------------------------------------------
def test_missing_backend_gives_an_unsupported_row_with_the_install_command(monkeypatch):
    import accelab.backends as backends
    from accelab.benchmark.engine import BenchJob, measure_in_child
    from accelab.scenarios.workload import Workload

    real = backends.importlib.util.find_spec
    monkeypatch.setattr(
        backends.importlib.util, "find_spec", lambda name, *a: None if name == "openvino" else real(name, *a)
    )
    assert not is_installed("openvino")
    job = BenchJob(
        spec=catalog_spec("minilm-l6"),
        plan=PRESETS["openvino"],
        workload=Workload(scenario="forward", batch_size=1, seq_len=16),
    )
    output = measure_in_child(job)
    assert output.status == "unsupported"
    assert "openvino" in output.reason and "pip install openvino" in output.reason


def test_no_gguf_and_not_a_gguf(tmp_path):
    with pytest.raises(Unsupported, match="has no GGUF"):
        load_backend(catalog_spec("minilm-l6"), PRESETS["llamacpp"], CPU)
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 this is a zip, not a GGUF")
    from accelab.backends.llamacpp import check_gguf, gguf_path

    with pytest.raises(ValueError, match=r"is not a GGUF file: it starts with b'PK\\x03\\x04'"):
        check_gguf(fake)
    spec = ModelSpec(name="fake", task="text-generation", source=str(tmp_path), gguf_file="model.gguf")
    with pytest.raises(ValueError, match="not a GGUF"):
        gguf_path(spec)


# -- the export cache, on a tiny BERT ----------------------------------------------------------------
@pytest.fixture
def tiny_bert(tmp_path, monkeypatch) -> ModelSpec:
    """A 2-layer BERT with random weights and the MiniLM tokenizer, exported under a private cache."""
    from transformers import BertConfig, BertModel

    minilm = Path(catalog_spec("minilm-l6").source)  # before the cache moves
    monkeypatch.setenv("ACCELAB_CACHE", str(with_limits(tmp_path / "cache")))
    source = tmp_path / "tiny-bert"
    torch.manual_seed(0)
    BertModel(
        BertConfig(
            vocab_size=30522,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=128,
        )
    ).save_pretrained(source)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm / name, source / name)
    return ModelSpec(name="tiny-bert", task="feature-extraction", source=str(source))


def test_export_is_cached_and_a_changed_model_re_exports(tiny_bert, monkeypatch):
    calls = []
    real_export = export.export_to
    monkeypatch.setattr(export, "export_to", lambda *a: calls.append(a) or real_export(*a))

    first = export.onnx_graph(tiny_bert)
    second = export.onnx_graph(tiny_bert)
    assert len(calls) == 1 and first == second
    assert first.path.is_file() and first.input_names == ("input_ids", "token_type_ids", "attention_mask")
    assert not list(first.directory.parent.glob(".tmp-*"))  # the temporary directory was renamed

    weights = Path(tiny_bert.source) / "model.safetensors"
    later = time.time() + 10
    os.utime(weights, (later, later))
    third = export.onnx_graph(tiny_bert)
    assert len(calls) == 2 and third.directory != first.directory


def test_tiny_bert_runs_on_ort_fused_and_openvino_like_torch(tiny_bert):
    """ONNX Runtime first, then OpenVINO in the same thread: ORT's session flushes denormals on the
    thread that makes it, which is put back (left on, OpenVINO's CPU plugin failed to infer a shape
    on an AVX2 EPYC: "Broadcast node ... Value -1 not in range")."""
    from accelab.catalog.inputs import forward_batch

    reference = load_runnable(tiny_bert, PRESETS["baseline"], CPU)
    batch = forward_batch(reference.as_loaded(), 3, seq_len=24)  # another shape than the export's
    want = reference.forward(batch).last_hidden_state
    for plan in (PRESETS["onnxruntime-fused"], PRESETS["openvino"]):
        with load_runnable(tiny_bert, plan, CPU) as runnable:
            got = runnable.forward(batch).last_hidden_state
            assert got.shape == want.shape and (got - want).abs().max() < 1e-4, plan.name
            assert runnable.weight_bytes > 30522 * 32 * 4  # the embedding table alone
            assert 1e-310 * 1.0 > 0.0, plan.name  # a subnormal double survives: no flush left on this thread


@pytest.mark.slow
def test_compare_reuses_the_export(tiny_bert, tmp_path):
    """Two compares in child processes: the second finds the graph the first exported."""
    env = {**os.environ, "ACCELAB_CACHE": os.environ["ACCELAB_CACHE"]}
    model_dir = Path(tiny_bert.source)
    args = [
        sys.executable,
        "-m",
        "accelab",
        "compare",
        str(model_dir),
        "--task",
        "feature-extraction",
        "--plans",
        "onnxruntime",
        "--no-quality",
        "--no-store",
        "--seq-len",
        "16",
        "--warmup",
        "1",
        "--min-iters",
        "2",
        "--min-seconds",
        "0.1",
    ]
    stamps = []
    for _ in range(2):
        proc = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        graphs = list((Path(env["ACCELAB_CACHE"]) / "exports").glob("*/model.onnx"))
        assert len(graphs) == 1
        stamps.append(graphs[0].stat().st_mtime_ns)
    assert stamps[0] == stamps[1]


# -- real catalog models ------------------------------------------------------------------------------
@pytest.mark.slow
def test_minilm_on_ort_and_openvino_matches_torch():
    from accelab.catalog.inputs import forward_batch

    spec = catalog_spec("minilm-l6")
    reference = load_runnable(spec, PRESETS["baseline"], CPU)
    batches = [forward_batch(reference.as_loaded(), b, seq_len=s) for b, s in ((1, 128), (4, 40))]
    wants = [reference.forward(b).last_hidden_state for b in batches]
    for name in ("onnxruntime", "onnxruntime-fused", "openvino"):
        with load_runnable(spec, PRESETS[name], CPU) as runnable:
            for batch, want in zip(batches, wants):
                got = runnable.forward(batch).last_hidden_state
                assert got.shape == want.shape
                assert (got - want).abs().max() < 1e-4, name
            if name == "onnxruntime-fused":
                assert any("Attention x6" in note for note in runnable.notes), runnable.notes


@pytest.mark.slow
def test_vit_base_runs_on_ort_and_openvino():
    from accelab.catalog.inputs import forward_batch

    spec = catalog_spec("vit-base")
    reference = load_runnable(spec, PRESETS["baseline"], CPU)
    batch = forward_batch(reference.as_loaded(), 2)
    want = reference.forward(batch).logits
    for name in ("onnxruntime", "onnxruntime-fused", "openvino"):
        with load_runnable(spec, PRESETS[name], CPU) as runnable:
            logits = runnable.forward(batch).logits
            assert logits.shape == (2, 1000)
            assert (logits - want).abs().max() < 1e-3, name
            if name == "onnxruntime-fused":  # transformers 5's Mul-scaled attention, rewritten to fuse
                assert any("Attention x12" in note for note in runnable.notes), runnable.notes
            with pytest.raises(ValueError, match="fixes axis 2 at 224"):
                runnable.forward({"pixel_values": torch.zeros(1, 3, 160, 160)})


@pytest.mark.slow
def test_compare_cli_gives_reasoned_rows(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelab",
            "compare",
            "minilm-l6",
            "--plans",
            "baseline,onnxruntime,llamacpp",
            "--no-quality",
            "--no-store",
            "--seq-len",
            "32",
            "--warmup",
            "1",
            "--min-iters",
            "3",
            "--min-seconds",
            "0.3",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = {r["plan"]["name"]: r for r in _results(json.loads(out.read_text()))}
    assert results["baseline"]["status"] == "ok" and results["onnxruntime"]["status"] == "ok"
    assert results["onnxruntime"]["metrics"]["throughput"] > 0
    assert results["llamacpp"]["status"] == "unsupported"
    reason = results["llamacpp"]["reason"]
    assert ("no GGUF" in reason) or ("pip install" in reason and "llama" in reason), reason


def _results(document):
    if isinstance(document, dict):
        document = document.get("results") or document.get("rows")
    return [r.get("result", r) for r in document]


# -- llama.cpp ----------------------------------------------------------------------------------------
llama = pytest.mark.skipif(
    not is_installed("llamacpp"), reason='llama-cpp-python is not installed (pip install -e ".[llamacpp]")'
)


@pytest.fixture(scope="module")
def smollm2_llamacpp():
    spec = catalog_spec("smollm2-135m")
    # one thread: ggml's spinning thread barrier collapses when the cores are shared (2 tok/s)
    with load_runnable(spec, backend_plan("llamacpp", llama_threads="1"), CPU) as runnable:
        yield runnable


class CountingCriterion:
    def __init__(self):
        self.calls = []

    def __call__(self, input_ids, scores, **kwargs):
        self.calls.append(input_ids.shape[1])
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@llama
def test_llamacpp_calls_the_criteria_once_per_token(smollm2_llamacpp):
    from accelab.catalog.inputs import generate_batch

    runnable = smollm2_llamacpp
    batch = generate_batch(runnable.as_loaded(), 1)  # "What is the capital of France?"
    criterion = CountingCriterion()
    out = runnable.generate(batch, max_new_tokens=12, min_new_tokens=12, do_sample=False, stopping_criteria=[criterion])
    prompt = batch["input_ids"].shape[1]
    assert out.shape == (1, prompt + 12) and torch.equal(out[:, :prompt], batch["input_ids"])
    assert criterion.calls == list(range(prompt + 1, prompt + 13))  # once per token, after it exists
    assert runnable.weight_bytes == Path(runnable.spec.source, "gguf/SmolLM2-135M-Instruct.Q4_1.gguf").stat().st_size


@llama
def test_llamacpp_knows_paris(smollm2_llamacpp):
    """Through the chat template, the first answer token is a near-tie: torch's fp32 arithmetic
    picks "The" (... Paris), llama.cpp's Q4_1 x Q8 dot products pick "L" ("L'Étoile") by 0.25
    logits. So: "The" must be in llama.cpp's top 2 there, and a plain prompt must say Paris."""
    from accelab.catalog.inputs import generate_batch

    runnable, tokenizer = smollm2_llamacpp, smollm2_llamacpp.processor
    batch = generate_batch(runnable.as_loaded(), 1)
    with torch.inference_mode():
        first = runnable.model(**batch).logits[0, -1]
    assert "The" in [tokenizer.decode(int(i)) for i in first.topk(2).indices]
    ids = dict(tokenizer("What is the capital of France? The capital of France is", return_tensors="pt"))
    out = runnable.generate(ids, max_new_tokens=4, min_new_tokens=4)
    assert "Paris" in tokenizer.decode(out[0, ids["input_ids"].shape[1] :])


@llama
def test_llamacpp_batch_rows_decode_like_single_rows_and_ignore_eos(smollm2_llamacpp):
    """Each row of a left-padded batch decodes as its own sequence: re-scored alone (teacher
    forcing), every token it produced is the greedy one up to rounding (batched and single-row
    kernels round differently, so exact argmax ties may flip)."""
    from accelab.catalog.inputs import generate_batch

    runnable = smollm2_llamacpp
    batch = generate_batch(runnable.as_loaded(), 3)  # three prompts of different lengths
    criterion = CountingCriterion()
    out = runnable.generate(batch, max_new_tokens=24, min_new_tokens=24, stopping_criteria=[criterion])
    width = batch["input_ids"].shape[1]
    assert out.shape == (3, width + 24) and len(criterion.calls) == 24  # steps, not rows x steps
    for row in range(3):
        real = torch.cat([batch["attention_mask"][row].bool(), torch.ones(24, dtype=torch.bool)])
        sequence = out[row][real][None]  # padding removed: prompt + 24 new tokens
        with torch.inference_mode():
            logits = runnable.model(input_ids=sequence).logits[0, -25:-1]  # the 24 steps' logits
        chosen = logits.gather(1, sequence[0, -24:, None])[:, 0]
        assert (logits.max(dim=1).values - chosen).max() < 0.5, row


@llama
def test_llamacpp_decodes_past_eos_until_min_new_tokens(smollm2_llamacpp):
    runnable, tokenizer = smollm2_llamacpp, smollm2_llamacpp.processor
    ids = dict(tokenizer("What is the capital of France?", return_tensors="pt"))  # no chat template: EOS first
    width, eos = ids["input_ids"].shape[1], runnable.model.engine.eos
    stopped = runnable.generate(ids, max_new_tokens=6, min_new_tokens=1)
    assert stopped.shape == (1, width + 1) and int(stopped[0, -1]) == eos
    forced = runnable.generate(ids, max_new_tokens=6, min_new_tokens=6)
    assert forced.shape == (1, width + 6) and int(forced[0, width]) == eos


@llama
def test_llamacpp_requantises_once_and_caches(tmp_path, monkeypatch):
    import llama_cpp

    spec = catalog_spec("smollm2-135m")  # resolved before the cache moves: the model stays where it is
    monkeypatch.setenv("ACCELAB_CACHE", str(tmp_path))
    calls = []
    real = llama_cpp.llama_model_quantize
    monkeypatch.setattr(llama_cpp, "llama_model_quantize", lambda *a: calls.append(a) or real(*a))
    plan = backend_plan("llamacpp", llama_quant="q4_0", llama_threads="1")
    for _ in range(2):
        with load_runnable(spec, plan, CPU) as runnable:
            assert list(tmp_path.glob("exports/gguf-q4_0-*/model.gguf"))
            assert runnable.weight_bytes < Path(spec.source, "gguf/SmolLM2-135M-Instruct.Q4_1.gguf").stat().st_size
            assert any("requantised to q4_0" in note for note in runnable.notes)
            ids = dict(runnable.processor("The capital of France is", return_tensors="pt"))
            assert runnable.generate(ids, max_new_tokens=3, min_new_tokens=3).shape[1] == ids["input_ids"].shape[1] + 3
    assert len(calls) == 1


@llama
def test_llamacpp_scores_every_position(smollm2_llamacpp):
    runnable = smollm2_llamacpp
    ids = runnable.processor("The capital of France is Paris. The capital of Germany is", return_tensors="pt").input_ids
    with torch.inference_mode():
        logits = runnable.model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], runnable.model.engine.n_vocab)
    nll = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
    assert float(nll) < 5.0  # a real language model, not noise (uniform would be ln(49152) = 10.8)
    assert runnable.processor.decode(int(logits[0, -1].argmax())).strip() == "Berlin"
