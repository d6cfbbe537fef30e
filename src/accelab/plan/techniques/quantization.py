"""Weight quantization with torchao `quantize_`, on the Linear layers of the model body.

The output head (lm_head, classifier) keeps its precision unless the plan says `quantize_head`:
it is one layer, often the largest (SmolLM2's 49k-vocab lm_head), and torchao's kernels ran it
slower. The served int8 GEMM (AMX) reads it at half the bytes, where it is a third of a decoding
step's reads (Llama-3.2-1B's 128k vocabulary). Embeddings are not Linear layers and are left alone;
a head tied to them is untied (the embedding keeps its precision).

torchao swaps each weight for a tensor subclass (int8 data + scales). In eager mode on CPU
that dequantizes per call and is slower than fp32; the gain comes with torch.compile.
torchao's `set_inductor_config` would flip process-wide inductor flags (and
`set_float32_matmul_precision("high")`, i.e. TF32) without restoring them, so it is off.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
from collections.abc import Callable
from typing import Any

import torch

from accelab.catalog.spec import ModelSpec
from accelab.plan import quantized_load
from accelab.plan.plan import Plan
from accelab.plan.runtime import Runnable, Unsupported
from accelab.plan.techniques import precision

log = logging.getLogger(__name__)

HEAD_NAMES = ("lm_head", "classifier", "score", "qa_outputs", "head")
INT4_GROUP_SIZE = 128
_PROBE_FEATURES = 256  # a probe Linear that every kernel's shape rules accept


def check(plan: Plan, spec: ModelSpec, device: torch.device) -> None:
    if plan.quantization == "none":
        return
    if importlib.util.find_spec("torchao") is None:
        raise Unsupported(
            f"quantization={plan.quantization} needs torchao, which is not installed (pip install torchao)"
        )
    if plan.placement in ("cpu-offload", "disk-offload"):
        raise Unsupported(
            "torchao quantizes weights held in memory; offloaded layers are loaded per call and would stay unquantized"
        )
    dtype = _weight_dtype(plan)
    error = probe(plan.quantization, device, dtype)
    if error is None:
        return
    version = importlib.metadata.version("torchao")
    if plan.quantization == "int4-weight" and device.type == "cpu":
        raise Unsupported(
            f"int4 weight-only has no CPU kernel in torchao {version}: its packed formats run on CUDA "
            "(tinygemm) or need the mslk package, and the CPU fallback (IntxWeightOnlyConfig) keeps the int4 "
            f"values unpacked in int8, saving nothing over int8-weight ({error})"
        )
    if plan.quantization == "int4-weight" and dtype != torch.bfloat16:
        raise Unsupported(
            f"int4 weight-only (tinygemm) in torchao {version} needs bf16 weights: combine it with "
            f"precision=bf16-weights ({error})"
        )
    raise Unsupported(f"torchao {version} cannot run {plan.quantization} on {device.type} with {dtype}: {error}")


def _weight_dtype(plan: Plan) -> torch.dtype:
    return precision.load_kwargs(plan)["dtype"]


def probe(quantization: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """Quantize and run one small Linear on `device`; the error text, or None when it works."""
    layer = torch.nn.Sequential(torch.nn.Linear(_PROBE_FEATURES, _PROBE_FEATURES)).to(device=device, dtype=dtype)
    try:
        from torchao.quantization import quantize_

        quantize_(layer, make_config(quantization, device))
        with torch.inference_mode():
            layer(torch.randn(2, _PROBE_FEATURES, device=device, dtype=dtype))
    except Exception as exc:  # noqa: BLE001 - torchao reports missing kernels as ImportError, AssertionError, ...
        return f"{type(exc).__name__}: {exc}".strip()
    return None


def make_config(quantization: str, device: torch.device) -> Any:
    from torchao.quantization import Int4WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig
    from torchao.quantization.quantize_.workflows import Int4PackingFormat

    if quantization == "int8-weight":
        return Int8WeightOnlyConfig(set_inductor_config=False)
    if quantization == "int8-dynamic":
        return Int8DynamicActivationInt8WeightConfig(set_inductor_config=False)
    if quantization == "int4-weight":
        # torchao 0.18's default packing ("plain") needs the mslk package; tinygemm's
        # tile_packed_to_4d is the CUDA kernel that ships with torchao itself
        packing = Int4PackingFormat.TILE_PACKED_TO_4D if device.type == "cuda" else Int4PackingFormat.PLAIN
        return Int4WeightOnlyConfig(group_size=INT4_GROUP_SIZE, int4_packing_format=packing, set_inductor_config=False)
    raise ValueError(
        f"quantization={quantization!r} has no torchao config; choose int8-weight, int8-dynamic, int4-weight"
    )


def apply(runnable: Runnable, plan: Plan) -> None:
    """Quantize the body's Linear layers in place (unless the loader did, shard by shard: `load`);
    records their count (`quantized_layers`) and notes."""
    if plan.quantization == "none":
        return
    model, device = runnable.model, runnable.device
    if runnable.quantized_on_load is None:
        from torchao.quantization import quantize_

        chosen = choose(model, plan)
        names = [name for name, module in model.named_modules() if chosen(module, name)]
        quantize_(model, make_config(plan.quantization, device), filter_fn=chosen)
    else:
        names = runnable.quantized_on_load
    total = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    runnable.quantized_layers = len(names)
    skip = _kept(model, plan)
    kept = f" (kept {', '.join(sorted(skip))} in full precision)" if skip else ""
    runnable.notes.append(f"torchao {plan.quantization}: {len(names)} of {total} Linear layers{kept}")
    if device.type == "cpu" and plan.compile == "off":
        runnable.notes.append(
            "torchao int kernels dequantize per call in eager mode on CPU: expect slower without compile"
        )
    log.info("quantized %d of %d Linear layers to %s", len(names), total, plan.quantization)


def load(spec: ModelSpec, plan: Plan, device: torch.device, load_kwargs: dict[str, Any]) -> Any:
    """The model loaded shard by shard and quantized as it goes (`accelab.plan.quantized_load`),
    with the names of the layers it quantized; None where it loads the ordinary way (the reason
    logged). `load_kwargs`: the plan's from_pretrained arguments (dtype, attention)."""
    extra = load_kwargs.keys() - {"dtype", "attn_implementation"}
    reason = quantized_load.why_not(spec, plan, device) or (
        f"from_pretrained options {sorted(extra)} apply" if extra else None
    )
    if reason is not None:
        log.info("%s loads whole, then quantizes: %s", spec.name, reason)
        return None
    return quantized_load.load_quantized(
        spec,
        dtype=load_kwargs["dtype"],
        choose=lambda model: choose(model, plan),
        config=make_config(plan.quantization, device),
        attn_implementation=load_kwargs.get("attn_implementation"),
    )


def choose(model: torch.nn.Module, plan: Plan) -> Callable[[torch.nn.Module, str], bool]:
    """The plan's filter of the Linear layers to quantize in `model` (its module names decide)."""
    return layer_filter(plan.quantization, _kept(model, plan))


def _kept(model: torch.nn.Module, plan: Plan) -> set[str]:
    skip = set() if plan.quantize_head else head_modules(model)
    if plan.quantization in WEIGHT_ONLY:
        skip |= vision_modules(model)
    return skip


WEIGHT_ONLY = ("int8-weight", "int4-weight")
VISION_PARTS = ("vision_model", "vision_tower", "connector", "multi_modal_projector")


def vision_modules(model: torch.nn.Module) -> set[str]:
    """A vision-language model's vision tower and projector (qualified names); none for other
    models. Weight-only quantization leaves them in full precision: a tower's GEMMs take an
    image's ~1000 patches at once, bound by compute, where int8 weights only add their
    dequantization (SmolVLM-256M's tower: 0.22 s an image in bf16); the language part's decoding
    steps read every weight for a few rows, where half the bytes is the gain."""
    get_output = getattr(model, "get_output_embeddings", None)
    if get_output is None or get_output() is None:
        return set()
    names = {name for name, _ in model.named_modules() if name.split(".")[-1] in VISION_PARTS}
    return {name for name in names if not any(name.startswith(other + ".") for other in names)}


def head_modules(model: torch.nn.Module) -> set[str]:
    """Qualified names of the output heads: the output embedding and top-level classifier heads."""
    heads: set[str] = set()
    get_output = getattr(model, "get_output_embeddings", None)
    output = get_output() if get_output is not None else None
    for name, module in model.named_modules():
        if module is output or (name.split(".")[-1] in HEAD_NAMES and name.count(".") <= 1):
            heads.add(name)
    return heads


def layer_filter(quantization: str, skip: set[str]) -> Callable[[torch.nn.Module, str], bool]:
    def chosen(module: torch.nn.Module, name: str) -> bool:
        if not isinstance(module, torch.nn.Linear):
            return False
        if any(name == head or name.startswith(head + ".") for head in skip):
            return False
        if quantization == "int4-weight" and module.in_features % INT4_GROUP_SIZE:
            return False  # int4 groups run along in_features
        return True

    return chosen
