"""ONNX Runtime: the exported graph, optionally fused and int8-quantised, in an InferenceSession.

The recipe, one step each: export (cached), ORT's transformer optimizer (`ort_fusion=on`),
dynamic int8 quantisation (`ort_quant=int8-dynamic`; after fusion, so the fused Attention
becomes QAttention), then a session with the plan's threads and graph optimisation level.

Three CPU choices decide whether a fusion pays (measured on MiniLM-L6, seq 128, 2 threads, ORT 1.32):
- Denormals are flushed (`session.set_denormal_as_zero`). A padded batch (real sentences of ~16
  tokens padded to 128) has masked softmax scores whose MLAS exp underflows to subnormal floats;
  the probabilities x V products on them then take the slow microcode path. The masked Softmax
  went from 1.0 to 7.5 ms per forward, and the fused Attention op (softmax and that product
  inside) from 10.4 to 15-20 ms, more than the fusion saves: on real inputs the fused plan ran
  slower than the unfused one. Flushing only changes values below 1.2e-38. ORT sets the flush
  (MXCSR's FTZ and DAZ bits) on its own threads and, when the session is made, on the calling one:
  that thread's setting is put back after (`_caller_fp_env_kept`), or it would stay for whatever
  runs there next (OpenVINO's CPU plugin, in the same process, then failed to infer a shape on an
  AVX2 EPYC: "Broadcast node ... Value -1 not in range").
- No SkipLayerNormalization on CPU: ORT's CPU kernel of it is a scalar loop per row, 2.4-3x
  slower than the Add, Add and LayerNormalization it replaces (172 vs 72 us per [1,128,384],
  5.3 vs 1.8 ms per [32,128,384], 2 threads), so neither the Python optimizer nor the session's
  own SkipLayerNormFusion (which would redo it at level 2+ on the optimizer's graph) makes it.
- No BiasGelu from the Python optimizer on CPU: int8 quantisation then folds the bias into the
  DynamicQuantizeMatMul before the Gelu, and a bare Gelu takes half the time of BiasGelu (3.7 vs
  7.3 ms per [32,128,1536]); at fp32 the session's own BiasGeluFusion still makes it (a wash there).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from accelab.backends.export import Graph, derived_graph, onnx_graph
from accelab.backends.graph_model import GraphModel, graph_runnable, model_config
from accelab.catalog.spec import ModelSpec
from accelab.plan.backend_options import OrtOptions
from accelab.plan.plan import Plan
from accelab.plan.runtime import Runnable, Unsupported

log = logging.getLogger(__name__)

# config.model_type -> the model_type ORT's optimizer takes; others have no fusion recipe there
FUSION_MODEL_TYPES = {
    "bert": "bert",
    "roberta": "bert",
    "xlm-roberta": "bert",
    "electra": "bert",
    "camembert": "bert",
    "vit": "vit",
    "deit": "vit",
}
_QUANT_OPS = {"all": None, "matmul": ["MatMul"], "attention": ["Attention"]}  # None: the quantizer's default set
_OPT_LEVELS = {"0": "ORT_DISABLE_ALL", "1": "ORT_ENABLE_BASIC", "2": "ORT_ENABLE_EXTENDED", "99": "ORT_ENABLE_ALL"}
# the session's own fusions left out on CPU, where their kernel is slower than the ops they replace
CPU_DISABLED_OPTIMIZERS = ["SkipLayerNormFusion"]


def load(spec: ModelSpec, plan: Plan, device: torch.device, threads: int) -> Runnable:
    import onnxruntime as ort

    options = OrtOptions.parse(plan.option)
    provider = execution_provider(options, device, ort.get_available_providers())
    notes = [f"ONNX Runtime {ort.__version__} on {provider}, {threads} intra-op threads, opt level {options.opt_level}"]
    if provider == "CPUExecutionProvider":
        notes.append(
            "denormals flushed to zero; no SkipLayerNormalization (its CPU kernel is slower than Add+LayerNorm)"
        )

    # 1. the exported graph (cached)
    graph = onnx_graph(spec)
    notes.append(f"ONNX graph {graph.directory.name} (legacy exporter{'' if spec.custom else ', eager attention'})")

    # 2. transformer fusions
    if options.fusion == "on":
        graph, fused = fuse(graph, use_gpu=provider.startswith("CUDA"))
        notes.append(f"ORT transformer optimizer ({FUSION_MODEL_TYPES[graph.model_type]}): {fused}")

    # 3. int8 dynamic quantisation of the weights (activations quantised per call)
    if options.quant == "int8-dynamic":
        graph = quantize(graph, options)
        notes.append(
            f"int8 dynamic quantisation of {options.quant_ops} ops (per_channel={options.per_channel}, "
            f"reduce_range={options.reduce_range})"
        )

    # 4. the session
    session = make_session(graph, options, provider, threads)
    log.info("onnxruntime session on %s for %s", provider, graph.path)
    output = [graph.output_name]
    model = GraphModel(lambda feeds: session.run(output, feeds)[0], graph, model_config(spec), "onnxruntime")
    return graph_runnable(spec, plan, device, model, graph, notes)


def execution_provider(options: OrtOptions, device: torch.device, available: list[str]) -> str:
    """CPUExecutionProvider, or CUDA's when the run is on a GPU and this onnxruntime has it."""
    wants_cuda = options.provider == "cuda" or (options.provider == "auto" and device.type == "cuda")
    if not wants_cuda:
        return "CPUExecutionProvider"
    if "CUDAExecutionProvider" not in available:
        raise Unsupported(
            "this onnxruntime has no CUDAExecutionProvider (it has "
            f"{', '.join(available)}): pip install onnxruntime-gpu, or run with --device cpu / ort_provider=cpu"
        )
    return "CUDAExecutionProvider"


def fuse(graph: Graph, *, use_gpu: bool) -> tuple[Graph, str]:
    """ORT's transformer optimizer on a BERT- or ViT-like graph; returns (graph, fused op counts)."""
    import onnxruntime

    model_type = FUSION_MODEL_TYPES.get(graph.model_type)
    if model_type is None:
        raise Unsupported(
            f"ORT's transformer optimizer fuses BERT- and ViT-like graphs ({', '.join(sorted(FUSION_MODEL_TYPES))}); "
            f"this model is {graph.model_type or 'of unknown type'}: use ort_fusion=off"
        )

    key = {
        "onnxruntime": onnxruntime.__version__,
        "model_type": model_type,
        "use_gpu": use_gpu,
        "scale_as_div": 1,
        "cpu": "no SkipLayerNorm, no BiasGelu",
        "heads": graph.num_heads,
        "hidden": graph.hidden_size,
    }
    fused = derived_graph(
        graph, "ort-fused", key, lambda src, dst: _optimize(src, dst, model_type, graph, use_gpu=use_gpu)
    )
    stats = json.loads((fused.directory / "fusions.json").read_text())
    if not stats.get("Attention") and not stats.get("MultiHeadAttention"):
        log.warning("ORT's optimizer fused no attention in %s: %s", graph.path, stats)
    return fused, ", ".join(f"{k} x{v}" for k, v in sorted(stats.items())) or "nothing fused"


def _optimize(src: Path, dst: Path, model_type: str, graph: Graph, *, use_gpu: bool) -> None:
    """The ONNX file at `src` through ORT's transformer optimizer into `dst`, with the fused op
    counts beside it (fusions.json)."""
    import onnx
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    model = onnx.load(str(src))
    rewritten = scale_as_division(model)
    log.info("attention scale Mul -> Div in %d places (the form ORT's no-mask attention fusion matches)", rewritten)
    fusions = FusionOptions(model_type)
    if not use_gpu:  # slower on CPU than what they replace: the module's docstring
        fusions.enable_skip_layer_norm = fusions.enable_bias_skip_layer_norm = False
        fusions.enable_bias_gelu = False
    # opt_level=0: the Python fusions only; the session applies ORT's own graph passes after
    optimized = optimize_model(
        model,
        model_type=model_type,
        num_heads=graph.num_heads,
        hidden_size=graph.hidden_size,
        opt_level=0,
        use_gpu=use_gpu,
        optimization_options=fusions,
    )
    stats = {k: v for k, v in optimized.get_fused_operator_statistics().items() if v}
    optimized.save_model_to_file(str(dst))
    (dst.parent / "fusions.json").write_text(json.dumps(stats))


def scale_as_division(model: Any) -> int:
    """Rewrite softmax(MatMul(q, k) * c) as softmax(MatMul(q, k) / (1 / c)), in place.

    transformers 5's eager attention scales by a Mul; ORT's attention fusion for graphs without
    a mask (ViT) only matches the Div that transformers 4 wrote, so ViT's attention stayed
    unfused. 1/c is exact for the usual head sizes (c = 1/8 for 64-wide heads). Returns the count.
    """
    from onnx import helper, numpy_helper

    producers = {out: node for node in model.graph.node for out in node.output}
    constants = {
        n.output[0]: numpy_helper.to_array(n.attribute[0].t)
        for n in model.graph.node
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"
    }
    constants.update({t.name: numpy_helper.to_array(t) for t in model.graph.initializer})
    count = 0
    for softmax in [n for n in model.graph.node if n.op_type == "Softmax"]:
        mul = producers.get(softmax.input[0])
        if mul is None or mul.op_type != "Mul":
            continue
        parents = [producers.get(name) for name in mul.input]
        scale_index = next(
            (i for i, name in enumerate(mul.input) if name in constants and constants[name].size == 1), None
        )
        other = None if scale_index is None else parents[1 - scale_index]
        if scale_index is None or other is None or other.op_type != "MatMul":
            continue
        scale = constants[mul.input[scale_index]]
        name = f"{mul.name}_reciprocal"
        model.graph.initializer.append(numpy_helper.from_array((1 / scale).astype(scale.dtype).reshape(()), name))
        div = helper.make_node("Div", [mul.input[1 - scale_index], name], list(mul.output), name=f"{mul.name}_as_div")
        position = list(model.graph.node).index(mul)
        model.graph.node.remove(mul)
        model.graph.node.insert(position, div)
        count += 1
    return count


def quantize(graph: Graph, options: OrtOptions) -> Graph:
    import onnxruntime

    def build(src: Path, dst: Path) -> None:
        import onnx
        from onnxruntime.quantization import QuantType, quantize_dynamic

        # DefaultTensorType: shape inference cannot type the outputs of fused com.microsoft ops
        # the quantizer logs an INFO line per tensor and generic advice (WARNING) on the root logger
        with _root_log_level(logging.ERROR):
            quantize_dynamic(
                src,
                dst,
                per_channel=options.per_channel == "on",
                reduce_range=options.reduce_range == "on",
                weight_type=QuantType.QInt8,
                op_types_to_quantize=_QUANT_OPS[options.quant_ops],
                extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
            )

    key = {
        "onnxruntime": onnxruntime.__version__,
        "per_channel": options.per_channel,
        "reduce_range": options.reduce_range,
        "ops": options.quant_ops,
    }
    return derived_graph(graph, "ort-int8-dynamic", key, build)


@contextlib.contextmanager
def _root_log_level(level: int) -> Iterator[None]:
    root = logging.getLogger()
    previous = root.level
    root.setLevel(max(level, previous))
    try:
        yield
    finally:
        root.setLevel(previous)


def make_session(graph: Graph, options: OrtOptions, provider: str, threads: int) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, _OPT_LEVELS[options.opt_level])
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1  # one graph at a time: parallelism is inside the ops
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3  # errors only: ORT warns about every unused initializer otherwise
    disabled = None
    if provider == "CPUExecutionProvider":  # why: the module's docstring
        so.add_session_config_entry("session.set_denormal_as_zero", "1")
        disabled = CPU_DISABLED_OPTIMIZERS
    with _caller_fp_env_kept():
        return ort.InferenceSession(
            str(graph.path), sess_options=so, providers=[provider], disabled_optimizers=disabled
        )


@contextlib.contextmanager
def _caller_fp_env_kept() -> Iterator[None]:
    """This thread's floating-point environment (x86's MXCSR: flush-to-zero, denormals-are-zero)
    as it was before the block, through glibc's fegetenv / fesetenv; elsewhere a no-op."""

    name = ctypes.util.find_library("m")
    libm = ctypes.CDLL(name) if name else None
    if libm is None or not hasattr(libm, "fegetenv"):
        yield
        return
    env = ctypes.create_string_buffer(64)  # fenv_t: 32 bytes on x86-64 glibc, the rest spare
    saved = libm.fegetenv(env) == 0
    try:
        yield
    finally:
        if saved:
            libm.fesetenv(env)
