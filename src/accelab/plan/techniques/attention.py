"""Attention implementation: a `from_pretrained(attn_implementation=...)` choice.

eager, sdpa and flex_attention run on CPU (flex_attention compiles its kernel with
torch.compile, so it needs a C++ compiler there); flash_attention_2 needs CUDA and the
flash_attn package. Models without attention layers (ResNet, ConvNeXt) have nothing to swap.
"""

from __future__ import annotations

import importlib.util

import torch

from accelab.catalog.spec import ModelSpec
from accelab.plan.plan import Plan
from accelab.plan.runtime import Unsupported
from accelab.plan.techniques import _model_info
from accelab.plan.techniques.compile import find_cpp_compiler

# Plan.attention -> the class flag transformers uses to say the model implements it
_SUPPORT_FLAGS = {
    "sdpa": "_supports_sdpa",
    "flash_attention_2": "_supports_flash_attn",
    "flex_attention": "_supports_flex_attn",
}


def check(plan: Plan, spec: ModelSpec, device: torch.device) -> None:
    if plan.attention == "default":
        return
    _model_info.needs_transformers(spec, f"attention={plan.attention} (an attention implementation of transformers)")
    if plan.attention == "flash_attention_2":
        if device.type != "cuda":
            raise Unsupported("flash_attention_2 runs only on CUDA GPUs; this run is on CPU")
        if importlib.util.find_spec("flash_attn") is None:
            raise Unsupported("flash_attention_2 needs the flash_attn package, which is not installed")
    if plan.attention == "flex_attention" and device.type == "cpu":
        if find_cpp_compiler() is None:
            raise Unsupported(
                "flex_attention compiles its kernel with torch.compile, which needs a C++ compiler on CPU"
            )
    config = _model_info.load_config(spec)
    cls = _model_info.model_class(spec, config) if config is not None else None
    if cls is None:
        return  # unknown layout: transformers decides at load time
    arch = _model_info.architecture(spec, config)
    if not any(getattr(cls, flag, False) for flag in _SUPPORT_FLAGS.values()):
        raise Unsupported(f"{arch} has no attention layers: attention={plan.attention} changes nothing")
    flag = _SUPPORT_FLAGS.get(plan.attention)
    if flag is not None and not getattr(cls, flag, False):
        raise Unsupported(f"{cls.__name__} does not implement attention={plan.attention} in transformers")


def load_kwargs(plan: Plan, spec: ModelSpec) -> dict:
    if plan.attention == "default":
        return {}
    return {"attn_implementation": plan.attention}
