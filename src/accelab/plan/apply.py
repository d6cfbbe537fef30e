"""apply_plan: load a model and apply a Plan's techniques in one fixed order.

The order, and why:
1. process settings (threads, TF32, cudnn.benchmark): before any kernel runs; restored on close.
2. load-time choices (attention implementation, weight dtype, device map / offload): they are
   `from_pretrained` arguments, so they decide how the weights are materialised.
3. device placement and memory format (channels_last): the layout the later steps must see.
4. weight quantization (torchao): on the final dtype and device, before compile traces it.
5. mixed precision (accelerate's autocast wrapper): wraps forward; compile then traces through it.
6. KV cache implementation: generate arguments only.
7. torch.compile, last: it must see the model exactly as it will run.
Each step raises `Unsupported` with the reason when it cannot help on this device.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from accelab.catalog.spec import ModelSpec
from accelab.plan.plan import Plan
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

log = logging.getLogger(__name__)

__all__ = ["apply_plan", "check_supported", "resolve_device", "Unsupported"]


def resolve_device(plan: Plan, requested: str | None = None) -> torch.device:
    """The device a plan runs on: --device, else the plan's placement, else CUDA when present."""
    if requested and requested != "auto":
        if requested.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--device {requested} asked for, but torch sees no CUDA GPU here; use --device cpu")
        return torch.device(requested)
    if plan.placement == "cpu":
        return torch.device("cpu")
    if plan.placement == "cuda" and not torch.cuda.is_available():
        raise Unsupported("placement=cuda needs a CUDA GPU; this machine has none")
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def check_supported(plan: Plan, spec: ModelSpec, device: torch.device) -> None:
    """Raise Unsupported before loading anything when a technique cannot run here."""
    for module in (system, attention, precision, placement, memory_format, quantization, kv_cache, compile_):
        module.check(plan, spec, device)


def apply_plan(spec: ModelSpec, plan: Plan, device: torch.device, *, offload_dir: str | None = None) -> Runnable:
    check_supported(plan, spec, device)
    if plan.backend != "torch":
        from accelab.backends import load_backend

        return load_backend(spec, plan, device)

    # 1. process settings, restored when the Runnable closes (or now, if a later step fails)
    runnable_stack = system.apply(plan, device)
    try:
        return _load_and_apply(spec, plan, device, runnable_stack, offload_dir)
    except BaseException:
        runnable_stack.close()
        raise


def _load_and_apply(
    spec: ModelSpec, plan: Plan, device: torch.device, runnable_stack: Any, offload_dir: str | None
) -> Runnable:
    # 2. load with the plan's from_pretrained arguments
    from accelab.catalog.load import load

    kwargs: dict[str, Any] = {}
    kwargs.update(attention.load_kwargs(plan, spec))
    kwargs.update(precision.load_kwargs(plan))
    kwargs.update(placement.load_kwargs(plan, device, offload_dir=offload_dir, spec=spec, exit_stack=runnable_stack))
    log.info("loading %s with %s", spec.name, kwargs)
    loaded = load(spec, **kwargs)
    model = loaded.model

    # 3. device and memory format
    model = placement.apply(model, plan, device)
    model = memory_format.apply(model, plan)

    # 4. weight quantization
    model = quantization.apply(model, plan, device)

    runnable = Runnable(
        model=model,
        processor=loaded.processor,
        device=device,
        task=spec.task,
        exit_stack=runnable_stack,
        placement=placement.describe(model),
        spec=spec,
        plan=plan,
    )
    runnable.notes.extend(getattr(model, "_accelab_notes", ()))  # left by memory format / quantization
    # 5. mixed precision (autocast through accelerate)
    precision.apply(runnable, plan)
    # 6. KV cache
    kv_cache.apply(runnable, plan)
    # 7. compile
    compile_.apply(runnable, plan)
    runnable.notes.extend(_notes(plan, runnable))
    return runnable


def _notes(plan: Plan, runnable: Runnable) -> list[str]:
    notes = []
    if runnable.placement:
        devices = sorted(set(runnable.placement.values()))
        notes.append(f"layers placed on {', '.join(devices)}")
    return notes
