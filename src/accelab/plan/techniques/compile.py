"""torch.compile, of the whole forward or of each repeated block ("regional").

- scope "model": `model.forward` is replaced by its compiled version. Compiling the bound
  method (not wrapping the module) keeps `generate`, the config and every attribute, and
  traces through accelerate's autocast wrapper when precision already rewrote forward.
- scope "regional": each block of the model's main layer stack (the largest ModuleList of
  same-class modules: decoder/encoder layers) is compiled with `Module.compile`. The blocks
  share code, so dynamo compiles one and reuses it: much shorter compile time, and often the
  same steady-state speed.

Compilation is lazy: it happens on the first call, which the caller times separately.
On CPU, inductor generates C++ and needs a compiler; "reduce-overhead" adds only CUDA
graphs to the default mode, which torch skips for CPU tensors, so it is reported as
unsupported there. "max-autotune" on CPU still autotunes the C++ GEMM templates.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from typing import Any

import torch

from accelab.catalog.spec import ModelSpec
from accelab.plan.plan import Plan
from accelab.plan.runtime import Runnable, Unsupported

log = logging.getLogger(__name__)

# The backend torch.compile uses. Tests set it to "eager" (dynamo traces, no code generation)
# or a counting callable to check the path quickly.
COMPILE_BACKEND: Any = "inductor"
_DYNAMIC = {"auto": None, "on": True, "off": False}


def find_cpp_compiler() -> str | None:
    """The C++ compiler inductor will call on CPU ($CXX, else g++/c++/clang++), or None."""
    candidates = [os.environ.get("CXX")] + ["g++", "c++", "clang++"]
    return next((path for path in map(_which, candidates) if path), None)


def _which(name: str | None) -> str | None:
    return shutil.which(name) if name else None


def check(plan: Plan, spec: ModelSpec, device: torch.device) -> None:
    if plan.compile == "off" or COMPILE_BACKEND != "inductor":
        return
    if device.type == "cpu":
        if find_cpp_compiler() is None:
            raise Unsupported("torch.compile (inductor) needs a C++ compiler on CPU; none found (install g++)")
        if plan.compile == "reduce-overhead":
            raise Unsupported(
                "reduce-overhead only adds CUDA graphs to the default mode; torch skips them for CPU "
                "tensors, so on CPU it is the same as compile=default"
            )
    elif device.type == "cuda":
        if importlib.util.find_spec("triton") is None:
            raise Unsupported("torch.compile (inductor) needs triton on CUDA; it is not installed")


def apply(runnable: Runnable, plan: Plan) -> None:
    if plan.compile == "off":
        return
    model = runnable.model
    options = compile_options(plan)
    if plan.compile_scope == "model":
        model.forward = torch.compile(model.forward, **options)
        scope = "model"
    else:
        blocks = repeated_blocks(model)
        if not blocks:
            raise Unsupported(
                f"regional compile found no repeated blocks in {type(model).__name__}; use compile_scope=model"
            )
        for block in blocks:
            block.compile(**options)
        scope = f"regional, {len(blocks)} {type(blocks[0]).__name__} blocks"
    if runnable.quantized_layers:
        # torchao's int8 matmuls fuse their scale multiply only with this flag; scoped to the run
        runnable.exit_stack.enter_context(torch._inductor.config.patch(force_fuse_int_mm_with_mul=True))
    # generate must not compile a second time on top of ours (transformers does with a static cache)
    runnable.generate_kwargs["disable_compile"] = True
    runnable.notes.append(f"compiled (mode={plan.compile}, scope={scope}, dynamic={plan.compile_dynamic})")
    log.info("torch.compile mode=%s scope=%s", plan.compile, scope)


def compile_options(plan: Plan) -> dict[str, Any]:
    options: dict[str, Any] = {
        "backend": COMPILE_BACKEND,
        "dynamic": _DYNAMIC[plan.compile_dynamic],
        "fullgraph": plan.compile_fullgraph,
    }
    if COMPILE_BACKEND == "inductor":  # mode is an inductor option; other backends reject it
        options["mode"] = None if plan.compile == "default" else plan.compile
    return options


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks of the largest ModuleList whose children all share one class (the layer stack)."""
    best: list[torch.nn.Module] = []
    best_size = 0
    for module in model.modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) < 2:
            continue
        children = list(module)
        if len({type(child) for child in children}) != 1:
            continue
        size = _parameter_count(module)
        if size > best_size:
            best, best_size = children, size
    return best


def _parameter_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
