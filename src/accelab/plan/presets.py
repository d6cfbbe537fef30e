"""Named plans. Each is a Plan that changes one thing from the fp32 eager baseline, or a
combination that is known to pay off together (compile with a static KV cache)."""

from __future__ import annotations

from accelab.plan.fields import Plan

_PRESETS = [
    Plan(name="baseline"),
    Plan(name="bf16-autocast", precision="bf16-autocast"),
    Plan(name="fp16-autocast", precision="fp16-autocast"),
    Plan(name="bf16", precision="bf16-weights"),
    Plan(name="fp16", precision="fp16-weights"),
    Plan(name="fp8", precision="fp8"),
    Plan(name="compile", compile="default"),
    Plan(name="compile-max", compile="max-autotune-no-cudagraphs"),
    Plan(name="compile-regional", compile="default", compile_scope="regional"),
    Plan(name="static-cache", kv_cache="static"),
    Plan(name="compile-static", compile="default", kv_cache="static"),
    Plan(name="sdpa", attention="sdpa"),
    Plan(name="eager-attention", attention="eager"),
    Plan(name="flash-attention", attention="flash_attention_2"),
    Plan(name="int8-weight", quantization="int8-weight"),
    Plan(name="int8-dynamic", quantization="int8-dynamic"),
    Plan(name="int4-weight", quantization="int4-weight"),
    Plan(name="int8-weight-compile", quantization="int8-weight", compile="default"),
    # int8 weights, bf16 activations: what torch's int8 x bf16 kernel (the serving steps) computes
    Plan(name="int8-bf16", precision="bf16-weights", quantization="int8-weight"),
    Plan(name="channels-last", memory_format="channels_last"),
    Plan(name="tf32", tf32=True, cudnn_benchmark=True),
    Plan(name="cpu-offload", placement="cpu-offload"),
    Plan(name="disk-offload", placement="disk-offload"),
    Plan(name="device-map", placement="device-map"),
    Plan(name="onnxruntime", backend="onnxruntime"),
    Plan(name="onnxruntime-fused", backend="onnxruntime", backend_options=(("ort_fusion", "on"),)),
    # int8 dynamic quantisation on the fused graph; full-range weights on CPUs with VNNI (no
    # saturation there), which kept MiniLM's embeddings at cosine >= 0.99 to fp32 here
    Plan(
        name="onnxruntime-int8",
        backend="onnxruntime",
        backend_options=(("ort_fusion", "on"), ("ort_quant", "int8-dynamic"), ("ort_reduce_range", "off")),
    ),
    Plan(name="openvino", backend="openvino"),
    Plan(name="openvino-bf16", backend="openvino", backend_options=(("ov_precision", "bf16"),)),
    # text generation on OpenVINO GenAI with NNCF-compressed weights (the fastest engine measured
    # on this project's CPU at int8 + bf16: docs/runtimes.md, OpenVINO GenAI as a runtime)
    Plan(name="openvino-int8", backend="openvino", backend_options=(("ov_weights", "int8"),)),
    Plan(
        name="openvino-int8-bf16",
        backend="openvino",
        backend_options=(("ov_precision", "bf16"), ("ov_weights", "int8")),
    ),
    Plan(name="openvino-int4", backend="openvino", backend_options=(("ov_weights", "int4"),)),
    Plan(name="llamacpp", backend="llamacpp"),
    # vLLM's engine (its own venv, see accelab.backends.vllm): fp32 like the baseline, and bf16
    Plan(name="vllm", backend="vllm"),
    Plan(name="vllm-bf16", backend="vllm", backend_options=(("vllm_dtype", "bfloat16"),)),
    Plan(name="vllm-compiled", backend="vllm", backend_options=(("vllm_mode", "compiled"),)),
]

PRESETS: dict[str, Plan] = {plan.name: plan for plan in _PRESETS}
