"""Each technique reaches the torch / accelerate / torchao call it claims, on tiny models (CPU).

Models are built from transformers configs with random weights and saved to temporary
directories, so `from_pretrained` arguments are exercised as the loader will pass them.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers

from accelab.catalog.facts import weight_bytes
from accelab.catalog.spec import ModelSpec
from accelab.plan.plan import Plan, load_plan
from accelab.plan.runtime import Runnable, Unsupported
from accelab.plan.techniques import (
    attention,
    compile as compile_,
    kv_cache,
    memory_format,
    placement,
    precision,
    quantization,
    system,
)

CPU = torch.device("cpu")


# -- tiny models ---------------------------------------------------------------------------
def _llama_config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def _resnet_config() -> transformers.ResNetConfig:
    return transformers.ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic", num_labels=10
    )


def _vit_config() -> transformers.ViTConfig:
    return transformers.ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        num_labels=10,
    )


def _bert_config() -> transformers.BertConfig:
    return transformers.BertConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
    )


def _tiny_llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(_llama_config()).eval()


@pytest.fixture(scope="module")
def llama_spec(tmp_path_factory) -> ModelSpec:
    path = tmp_path_factory.mktemp("tiny-llama")
    _tiny_llama().save_pretrained(path)
    return ModelSpec(name="tiny-llama", task="text-generation", source=str(path))


def _config_spec(tmp_path, config, task: str) -> ModelSpec:
    config.save_pretrained(tmp_path)
    return ModelSpec(name=config.model_type, task=task, source=str(tmp_path))


def _tokens(batch: int = 2, length: int = 12) -> torch.Tensor:
    return torch.randint(3, 256, (batch, length), generator=torch.Generator().manual_seed(1))


@pytest.fixture
def fresh_accelerate_state():
    """accelerate's state is a process singleton; each precision test starts and ends clean."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        check=False,
    )


# -- system ----------------------------------------------------------------------------------
def test_threads_set_inside_and_restored_after_close():
    before = torch.get_num_threads()
    wanted = 1 if before != 1 else 2
    runnable = Runnable(model=None, processor=None, device=CPU, task="")
    system.apply(runnable, Plan(threads=wanted))
    try:
        assert torch.get_num_threads() == wanted
    finally:
        runnable.close()
    assert torch.get_num_threads() == before


def test_tf32_and_cudnn_benchmark_flags_restored_after_close():
    matmul, conv = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision
    benchmark = torch.backends.cudnn.benchmark
    with Runnable(model=None, processor=None, device=CPU, task="") as runnable:
        system.apply(runnable, Plan(tf32=True, cudnn_benchmark=True))  # apply does not refuse CPU; check does
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        assert torch.backends.cudnn.conv.fp32_precision == "tf32"
        assert torch.backends.cudnn.benchmark is True
    assert torch.backends.cuda.matmul.fp32_precision == matmul
    assert torch.backends.cudnn.conv.fp32_precision == conv
    assert torch.backends.cudnn.benchmark is benchmark


def test_gpu_flags_and_too_many_threads_unsupported_on_cpu(llama_spec):
    with pytest.raises(Unsupported, match="TF32 and cudnn.benchmark are GPU settings; this run is on CPU"):
        system.check(Plan(tf32=True), llama_spec, CPU)
    with pytest.raises(Unsupported, match="more than the"):
        system.check(Plan(threads=system.available_cpus() + 1), llama_spec, CPU)
    system.check(Plan(threads=1), llama_spec, CPU)


def test_interop_threads_set_once_in_a_fresh_process():
    result = _run_python(
        """
        import torch
        from accelab.plan.plan import Plan
        from accelab.plan.runtime import Runnable, Unsupported
        from accelab.plan.techniques import system
        runnable = Runnable(model=None, processor=None, device=torch.device("cpu"), task="")
        system.apply(runnable, Plan(interop_threads=1))
        print("interop", torch.get_num_interop_threads())
        try:
            system.apply(runnable, Plan(interop_threads=2))
        except Unsupported as exc:
            print("second:", exc)
        """
    )
    assert result.returncode == 0, result.stderr
    assert "interop 1" in result.stdout
    assert "once per process" in result.stdout


# -- attention -------------------------------------------------------------------------------
def test_attention_checks(tmp_path, llama_spec):
    resnet = _config_spec(tmp_path, _resnet_config(), "image-classification")
    with pytest.raises(Unsupported, match="resnet has no attention layers"):
        attention.check(Plan(attention="sdpa"), resnet, CPU)
    attention.check(Plan(), resnet, CPU)  # default: nothing to check
    with pytest.raises(Unsupported, match="flash_attention_2 runs only on CUDA"):
        attention.check(Plan(attention="flash_attention_2"), llama_spec, CPU)
    for choice in ("eager", "sdpa", "flex_attention"):
        attention.check(Plan(attention=choice), llama_spec, CPU)
    assert attention.load_kwargs(Plan(), llama_spec) == {}
    assert attention.load_kwargs(Plan(attention="eager"), llama_spec) == {"attn_implementation": "eager"}


def test_attention_kwarg_reaches_the_model(llama_spec):
    kwargs = attention.load_kwargs(Plan(attention="eager"), llama_spec)
    model = transformers.LlamaForCausalLM.from_pretrained(llama_spec.source, dtype=torch.float32, **kwargs)
    assert model.config._attn_implementation == "eager"


# -- precision -------------------------------------------------------------------------------
def test_fp16_autocast_on_cpu_is_unsupported(llama_spec, fresh_accelerate_state):
    with pytest.raises(Unsupported, match="no-op"):
        precision.check(Plan(precision="fp16-autocast"), llama_spec, CPU)
    # accelerate's own verdict, past the check: native_amp is False on CPU for fp16
    runnable = Runnable(model=_tiny_llama(), processor=None, device=CPU, task="text-generation")
    with pytest.raises(Unsupported, match="no-op"):
        precision.apply(runnable, Plan(precision="fp16-autocast"))


def test_fp8_unsupported_on_cpu(llama_spec):
    with pytest.raises(Unsupported, match="fp8 needs a CUDA GPU with compute capability 8.9"):
        precision.check(Plan(precision="fp8"), llama_spec, CPU)


def test_precision_load_kwargs():
    assert precision.load_kwargs(Plan()) == {"dtype": torch.float32}
    assert precision.load_kwargs(Plan(precision="bf16-autocast")) == {"dtype": torch.float32}
    assert precision.load_kwargs(Plan(precision="bf16-weights")) == {"dtype": torch.bfloat16}
    assert precision.load_kwargs(Plan(precision="fp16-weights")) == {"dtype": torch.float16}


def test_bf16_autocast_active_inside_forward_and_generate(fresh_accelerate_state):
    model = _tiny_llama()
    seen: list[tuple[bool, torch.dtype]] = []
    model.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda module, args, output: seen.append((torch.is_autocast_enabled("cpu"), output.dtype))
    )
    runnable = Runnable(model=model, processor=None, device=CPU, task="text-generation")
    precision.apply(runnable, Plan(precision="bf16-autocast"))
    assert runnable.model is model  # accelerate rewrites forward in place
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.float32  # weights stay fp32
    assert any("bf16 autocast via accelerate" in note for note in runnable.notes)

    out = runnable.forward({"input_ids": _tokens()})
    assert seen and all(seen_item == (True, torch.bfloat16) for seen_item in seen)
    assert out.logits.dtype == torch.float32  # accelerate casts outputs back
    seen.clear()
    runnable.generate({"input_ids": _tokens(1, 4)}, max_new_tokens=3, do_sample=False)
    assert len(seen) == 3 and all(seen_item == (True, torch.bfloat16) for seen_item in seen)


def test_a_second_precision_in_one_process_is_refused_by_type(llama_spec, fresh_accelerate_state):
    first = Runnable(model=_tiny_llama(), processor=None, device=CPU, task="text-generation")
    precision.apply(first, Plan(precision="bf16-autocast"))
    second = Runnable(model=_tiny_llama(), processor=None, device=CPU, task="text-generation")
    with pytest.raises(precision.PrecisionConflict, match="mixed_precision='bf16'.*own process"):
        precision.apply(second, Plan(precision="fp8"))
    precision.apply(second, Plan(precision="bf16-autocast"))  # the same precision again is fine


def test_every_technique_applies_to_a_runnable_and_a_plan():
    import inspect

    for module in (system, placement, memory_format, quantization, precision, kv_cache, compile_):
        assert list(inspect.signature(module.apply).parameters) == ["runnable", "plan"], module.__name__
        assert list(inspect.signature(module.check).parameters) == ["plan", "spec", "device"], module.__name__


# -- placement -------------------------------------------------------------------------------
def test_disk_offload_places_layers_on_disk_and_keeps_logits(llama_spec):
    plan = Plan(placement="disk-offload")
    placement.check(plan, llama_spec, CPU)
    stack = contextlib.ExitStack()
    kwargs = placement.load_kwargs(plan, CPU, spec=llama_spec, exit_stack=stack)
    full = placement.model_bytes(llama_spec, plan)
    assert kwargs["device_map"] == "auto" and kwargs["max_memory"] == {"cpu": full // 2}
    folder = kwargs["offload_folder"]
    assert os.path.isdir(folder)

    offloaded = transformers.LlamaForCausalLM.from_pretrained(llama_spec.source, dtype=torch.float32, **kwargs)
    runnable = Runnable(model=offloaded, processor=None, device=CPU, task="text-generation")
    placement.apply(runnable, plan)
    assert runnable.model is offloaded and runnable.placement == placement.describe(offloaded)
    where = placement.describe(offloaded)
    assert "disk" in where.values() and "cpu" in where.values()
    assert any(p.device.type == "meta" for p in offloaded.parameters())  # really not in memory

    reference = transformers.LlamaForCausalLM.from_pretrained(llama_spec.source, dtype=torch.float32)
    tokens = _tokens()
    with torch.inference_mode():
        torch.testing.assert_close(offloaded(tokens).logits, reference(tokens).logits, atol=1e-5, rtol=0)
    assert placement.describe(reference) is None
    stack.close()
    assert not os.path.exists(folder)


def test_placement_unsupported_on_cpu(llama_spec):
    with pytest.raises(
        Unsupported, match="CPU offload moves weights from a GPU to CPU memory; this run is already on CPU"
    ):
        placement.check(Plan(placement="cpu-offload"), llama_spec, CPU)
    with pytest.raises(Unsupported, match="placement=cuda needs a CUDA GPU"):
        placement.check(Plan(placement="cuda"), llama_spec, CPU)
    with pytest.raises(Unsupported, match="device-map spreads layers over GPUs"):
        placement.check(Plan(placement="device-map"), llama_spec, CPU)
    assert placement.load_kwargs(Plan(), CPU) == {}
    explicit = placement.load_kwargs(Plan(placement="disk-offload", max_memory="cpu=1MB"), CPU, offload_dir="/tmp/x")
    assert explicit == {"device_map": "auto", "max_memory": {"cpu": "1MB"}, "offload_folder": "/tmp/x"}


# -- memory format ---------------------------------------------------------------------------
def test_the_quality_reference_uses_eager_attention_only_where_a_model_has_attention(tmp_path, llama_spec):
    from accelab.quality.verify import reference_plan

    resnet_spec = _config_spec(tmp_path / "resnet", _resnet_config(), "image-classification")
    assert reference_plan(llama_spec).attention == "eager"
    assert reference_plan(resnet_spec).attention == "default"  # asking a ResNet for eager attention is refused
    assert reference_plan(resnet_spec).precision == "fp32" and reference_plan(resnet_spec).compile == "off"


def test_channels_last_sets_conv_weights_and_refuses_vit(tmp_path):
    resnet_spec = _config_spec(tmp_path / "resnet", _resnet_config(), "image-classification")
    plan = Plan(memory_format="channels_last")
    memory_format.check(plan, resnet_spec, CPU)
    torch.manual_seed(0)
    model = transformers.ResNetForImageClassification(_resnet_config()).eval()
    pixels = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        expected = model(pixel_values=pixels).logits
    runnable = Runnable(model=model, processor=None, device=CPU, task="image-classification")
    memory_format.apply(runnable, plan)
    model = runnable.model
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert convs and all(c.weight.is_contiguous(memory_format=torch.channels_last) for c in convs)
    assert not convs[0].weight.is_contiguous()  # 7x7 stem: NHWC differs from NCHW
    batch = memory_format.prepare_batch({"pixel_values": pixels}, plan)
    assert batch["pixel_values"].is_contiguous(memory_format=torch.channels_last)
    with torch.inference_mode():
        torch.testing.assert_close(model(**batch).logits, expected, atol=1e-5, rtol=1e-5)

    vit_spec = _config_spec(tmp_path / "vit", _vit_config(), "image-classification")
    with pytest.raises(Unsupported, match="vit has a single convolution"):
        memory_format.check(plan, vit_spec, CPU)
    bert_spec = _config_spec(tmp_path / "bert", _bert_config(), "feature-extraction")
    with pytest.raises(Unsupported, match="no convolution layers: channels_last changes nothing for bert"):
        memory_format.check(plan, bert_spec, CPU)


# -- quantization ----------------------------------------------------------------------------
@pytest.mark.parametrize("choice", ["int8-weight", "int8-dynamic"])
def test_int8_weights_really_int8_and_close(llama_spec, choice):
    plan = Plan(quantization=choice)
    quantization.check(plan, llama_spec, CPU)
    model = _tiny_llama()
    tokens = _tokens()
    with torch.inference_mode():
        expected = model(tokens).logits
    runnable = Runnable(model=model, processor=None, device=CPU, task="text-generation")
    quantization.apply(runnable, plan)
    model = runnable.model

    weight = model.model.layers[0].mlp.down_proj.weight
    inner, _ = weight.__tensor_flatten__()
    assert getattr(weight, inner[0]).dtype == torch.int8  # qdata
    assert type(model.lm_head.weight) is torch.nn.Parameter and model.lm_head.weight.dtype == torch.float32
    assert runnable.quantized_layers == 4 * 7  # q, k, v, o, gate, up, down per layer; lm_head kept
    assert any("kept lm_head" in note for note in runnable.notes)
    with torch.inference_mode():
        got = model(tokens).logits
    assert ((got - expected).norm() / expected.norm()).item() < 0.05


def test_quantize_head_quantizes_the_output_head_too_and_leaves_a_tied_embedding_alone():
    model = _tiny_llama()
    model.config.tie_word_embeddings = True
    model.tie_weights()
    embedding = model.model.embed_tokens.weight.detach().clone()
    tokens = _tokens()
    with torch.inference_mode():
        expected = model(tokens).logits
    runnable = Runnable(model=model, processor=None, device=CPU, task="text-generation")
    quantization.apply(runnable, Plan(quantization="int8-weight", quantize_head=True))

    inner, _ = model.lm_head.weight.__tensor_flatten__()
    assert getattr(model.lm_head.weight, inner[0]).dtype == torch.int8
    assert runnable.quantized_layers == 4 * 7 + 1 and not any("kept" in note for note in runnable.notes)
    assert type(model.model.embed_tokens.weight) is torch.nn.Parameter  # the input embedding keeps its floats
    assert torch.equal(model.model.embed_tokens.weight, embedding)
    with torch.inference_mode():
        got = model(tokens).logits
    assert ((got - expected).norm() / expected.norm()).item() < 0.05
    with pytest.raises(ValueError, match="quantize_head=true needs a quantization"):
        Plan(quantize_head=True)
    assert load_plan("int8-bf16", ["quantize_head=true"]).quantize_head


def test_weight_only_int8_keeps_a_vlms_vision_tower_in_full_precision():
    """The language part's Linears go int8, the vision tower's and the projector's stay float
    (compute-bound: int8 weights would only add their dequantization); int8-dynamic, which
    quantizes the activations too, takes them all."""
    from transformers import AutoModelForImageTextToText

    from accelab.catalog.fetch import is_fetched
    from accelab.catalog.store import model_dir

    assert is_fetched("smolvlm-tiny"), "make models fetches smolvlm-tiny"

    def quantized(plan: Plan) -> tuple[set[str], Runnable]:
        model = AutoModelForImageTextToText.from_pretrained(model_dir("smolvlm-tiny"))
        runnable = Runnable(model=model, processor=None, device=CPU, task="image-text-to-text")
        quantization.apply(runnable, plan)
        names = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        return {n for n in names if type(model.get_submodule(n).weight) is not torch.nn.Parameter}, runnable

    int8, runnable = quantized(Plan(quantization="int8-weight"))
    assert int8 and all(n.startswith("model.text_model.") for n in int8)
    assert any("model.connector" in note and "model.vision_model" in note for note in runnable.notes)
    dynamic, _ = quantized(Plan(quantization="int8-dynamic"))
    assert any(n.startswith("model.vision_model.") for n in dynamic)
    assert "model.connector.modality_projection.proj" in dynamic


def test_int4_weight_unsupported_on_cpu(llama_spec):
    with pytest.raises(Unsupported, match="int4 weight-only has no CPU kernel in torchao"):
        quantization.check(Plan(quantization="int4-weight"), llama_spec, CPU)
    with pytest.raises(Unsupported, match="offloaded layers"):
        quantization.check(Plan(quantization="int8-weight", placement="disk-offload"), llama_spec, CPU)


# -- KV cache --------------------------------------------------------------------------------
def test_static_cache_same_greedy_tokens(tmp_path, llama_spec):
    bert = _config_spec(tmp_path, _bert_config(), "feature-extraction")
    with pytest.raises(Unsupported, match="static KV cache is a generate"):
        kv_cache.check(Plan(kv_cache="static"), bert, CPU)
    kv_cache.check(Plan(kv_cache="static"), llama_spec, CPU)

    model = _tiny_llama()
    dynamic = Runnable(model=model, processor=None, device=CPU, task="text-generation")
    static = Runnable(model=model, processor=None, device=CPU, task="text-generation")
    kv_cache.apply(static, Plan(kv_cache="static"))
    assert static.generate_kwargs["cache_implementation"] == "static"
    batch = {"input_ids": _tokens(2, 6), "attention_mask": torch.ones(2, 6, dtype=torch.long)}
    args = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False}
    out_dynamic = dynamic.generate(batch, **args)
    out_static = static.generate(batch, **args, return_dict_in_generate=True)
    assert type(out_static.past_key_values).__name__ == "StaticCache"
    assert torch.equal(out_dynamic, out_static.sequences)


# -- compile ---------------------------------------------------------------------------------
class _CountingBackend:
    """A torch.compile backend that records each graph dynamo hands it and runs it eagerly."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, graph_module, example_inputs):
        self.graphs += 1
        return graph_module.forward


@pytest.fixture
def counting_backend(monkeypatch):
    backend = _CountingBackend()
    monkeypatch.setattr(compile_, "COMPILE_BACKEND", backend)
    torch._dynamo.reset()
    yield backend
    torch._dynamo.reset()


@pytest.mark.slow
def test_model_compile_traces_forward_and_generate(counting_backend):
    model = _tiny_llama()
    tokens = _tokens()
    with torch.inference_mode():
        expected = model(tokens).logits
    runnable = Runnable(model=model, processor=None, device=CPU, task="text-generation")
    compile_.apply(runnable, Plan(compile="default"))
    assert any(note.startswith("compiled (mode=default, scope=model") for note in runnable.notes)
    got = runnable.forward({"input_ids": tokens}).logits
    assert counting_backend.graphs >= 1
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    generated = runnable.generate({"input_ids": tokens[:1, :4]}, max_new_tokens=3, do_sample=False)
    assert generated.shape == (1, 7)
    assert model.config.vocab_size == 256  # attributes survive: the module itself is not wrapped


def test_regional_compile_compiles_each_block(counting_backend):
    model = _tiny_llama()
    runnable = Runnable(model=model, processor=None, device=CPU, task="text-generation")
    compile_.apply(runnable, Plan(compile="default", compile_scope="regional"))
    blocks = compile_.repeated_blocks(model)
    assert blocks == list(model.model.layers) and len(blocks) == 4
    assert all(block._compiled_call_impl is not None for block in blocks)
    assert "regional, 4 LlamaDecoderLayer blocks" in runnable.notes[-1]
    runnable.forward({"input_ids": _tokens()})
    assert counting_backend.graphs >= 1


@pytest.mark.slow
def test_inductor_compile_matches_eager():
    """The real backend once, regionally on a tiny BERT (blocks share code: one compile)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = transformers.BertModel(_bert_config()).eval()
    tokens = _tokens(2, 16)
    with torch.inference_mode():
        expected = model(input_ids=tokens).last_hidden_state
    runnable = Runnable(model=model, processor=None, device=CPU, task="feature-extraction")
    compile_.apply(runnable, Plan(compile="default", compile_scope="regional"))
    from torch._dynamo.utils import counters

    before = counters["frames"]["ok"]
    got = runnable.forward({"input_ids": tokens}).last_hidden_state
    assert counters["frames"]["ok"] > before
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_compile_checks_on_cpu(llama_spec, monkeypatch):
    with pytest.raises(Unsupported, match="reduce-overhead only adds CUDA graphs"):
        compile_.check(Plan(compile="reduce-overhead"), llama_spec, CPU)
    compile_.check(Plan(compile="max-autotune"), llama_spec, CPU)
    monkeypatch.setattr(compile_.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(Unsupported, match="needs a C\\+\\+ compiler"):
        compile_.check(Plan(compile="default"), llama_spec, CPU)


# -- GPU paths, through fakes (no GPU here) --------------------------------------------------
CUDA = torch.device("cuda", 0)


def test_fp8_needs_capability_8_9_and_a_backend(llama_spec, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "FakeGPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(Unsupported, match="compute capability 8.9 or newer; FakeGPU has 8.0"):
        precision.check(Plan(precision="fp8"), llama_spec, CUDA)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(precision, "fp8_backend", lambda: None)
    with pytest.raises(Unsupported, match="needs one of torchao, transformer_engine or ms-amp"):
        precision.check(Plan(precision="fp8"), llama_spec, CUDA)
    monkeypatch.setattr(precision, "fp8_backend", lambda: "torchao")
    precision.check(Plan(precision="fp8"), llama_spec, CUDA)


def test_offload_budgets_on_a_gpu_run(llama_spec, monkeypatch):
    half = placement.model_bytes(llama_spec, Plan()) // 2
    cpu_offload = placement.load_kwargs(Plan(placement="cpu-offload"), CUDA, spec=llama_spec)
    assert cpu_offload["device_map"] == "auto" and cpu_offload["max_memory"][0] == half
    assert cpu_offload["max_memory"]["cpu"] > 0 and "offload_folder" not in cpu_offload
    with contextlib.ExitStack() as stack:
        disk = placement.load_kwargs(Plan(placement="disk-offload"), CUDA, spec=llama_spec, exit_stack=stack)
        assert disk["max_memory"] == {0: half} and os.path.isdir(disk["offload_folder"])
    bf16_half = placement.model_bytes(llama_spec, Plan(precision="bf16-weights")) // 2
    # sized at the dtype the plan loads: the bytes of the model loaded so, whose rotary inv_freq
    # buffers stay fp32 (a guess of every floating tensor at bf16 was 32 bytes short)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(llama_spec.source, dtype=torch.bfloat16)
    assert bf16_half == weight_bytes(loaded) // 2 > half // 2
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(Unsupported, match="names cuda:1, but this machine has 1 GPU"):
        placement.check(Plan(placement="device-map", max_memory="cuda:0=1GiB,cuda:1=1GiB"), llama_spec, CUDA)


def test_int4_on_cuda_uses_torchaos_own_tinygemm_kernel():
    from torchao.quantization.quantize_.workflows import Int4PackingFormat

    config = quantization.make_config("int4-weight", CUDA)
    assert config.int4_packing_format == Int4PackingFormat.TILE_PACKED_TO_4D
    assert config.set_inductor_config is False  # torchao would set TF32 process-wide otherwise
