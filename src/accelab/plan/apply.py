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
Each step raises `Unsupported` with the reason when it cannot help on this device. Every
technique module has the same two functions: `check(plan, spec, device)` before anything loads,
and `apply(runnable, plan)`, which records on the Runnable what it did (its model, notes,
generate arguments, settings to restore); steps 2's `load_kwargs` are from_pretrained arguments.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from accelab.catalog.load import load, load_processor
from accelab.catalog.spec import ModelSpec
from accelab.plan import fit
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

__all__ = ["apply_plan", "apply_to_model", "check_techniques", "resolve_device", "Unsupported"]


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


def check_techniques(plan: Plan, spec: ModelSpec, device: torch.device) -> None:
    """Raise Unsupported before loading anything when a torch technique cannot run here (the
    runtime's own check comes after: `accelab.runtimes.check_supported`)."""
    for module in (system, attention, precision, placement, memory_format, quantization, kv_cache, compile_):
        module.check(plan, spec, device)


def apply_plan(spec: ModelSpec, plan: Plan, device: torch.device, *, offload_dir: str | None = None) -> Runnable:
    """torch's runtime: load `spec` and apply the plan's techniques (checked by the caller,
    `accelab.runtimes.load_runnable`, the one way in)."""
    if plan.backend != "torch":
        raise ValueError(
            f"apply_plan runs torch plans; backend={plan.backend} loads through accelab.runtimes.load_runnable"
        )
    # the Runnable exists from the start: each step records on it what it did (its model, notes,
    # settings to restore), and closing it undoes step 1 (or a failure at any later step does)
    runnable = Runnable(model=None, processor=None, device=device, task=spec.task, spec=spec, plan=plan)
    try:
        # 1. process settings, restored when the Runnable closes
        system.apply(runnable, plan)
        fit.check(spec, plan, device)  # before a byte of the weights is read
        _load(runnable, spec, plan, offload_dir)
        _accelerate(runnable, plan)
    except BaseException:
        runnable.close()
        raise
    return runnable


def _load(runnable: Runnable, spec: ModelSpec, plan: Plan, offload_dir: str | None) -> None:
    # 2. load with the plan's from_pretrained arguments

    kwargs: dict[str, Any] = {}
    kwargs.update(attention.load_kwargs(plan, spec))
    kwargs.update(precision.load_kwargs(plan))
    kwargs.update(
        placement.load_kwargs(plan, runnable.device, offload_dir=offload_dir, spec=spec, exit_stack=runnable.exit_stack)
    )
    if runnable.device.type == "cpu" and (sharded := quantization.load(spec, plan, runnable.device, kwargs)):
        # 2 and 4 at once: each shard's Linear layers quantized before the next shard is read
        runnable.notes.append(f"loaded shard by shard ({sharded.shards} shards), quantizing as it went")
        runnable.model, runnable.processor = sharded.model, load_processor(spec)
        runnable.quantized_on_load = sharded.quantized
        return
    log.info("loading %s with %s", spec.name, kwargs)
    loaded = load(spec, **kwargs)
    runnable.model, runnable.processor = loaded.model, loaded.processor


def _accelerate(runnable: Runnable, plan: Plan) -> None:
    """Steps 3-7 on a model in memory (loaded by step 2, or handed over by `apply_to_model`);
    every technique is `apply(runnable, plan)`."""
    # 3. device and memory format
    placement.apply(runnable, plan)
    memory_format.apply(runnable, plan)
    # 4. weight quantization
    quantization.apply(runnable, plan)
    # 5. mixed precision (autocast through accelerate)
    precision.apply(runnable, plan)
    # 6. KV cache
    kv_cache.apply(runnable, plan)
    # 7. compile
    compile_.apply(runnable, plan)
    runnable.notes.extend(_notes(plan, runnable))


def apply_to_model(model: torch.nn.Module, plan: Plan, device: torch.device, *, processor: Any = None) -> Runnable:
    """The plan's techniques on a model object the caller already loaded (`accelab.apply`):
    the same steps in the same order as `apply_plan`, with step 2 done in place (attention
    implementation, weight dtype). Closing the Runnable restores the process settings."""
    if plan.backend != "torch":
        raise Unsupported(
            f"backend={plan.backend} exports and loads a model of its own; accelab.apply runs torch plans "
            "(run the backend through accelab.bench / accelab serve on the model's directory)"
        )
    if plan.placement not in ("auto", "cpu", "cuda"):  # a device map is materialised by from_pretrained
        raise Unsupported(
            f"placement={plan.placement} is a device map chosen at load time; load the model with "
            "from_pretrained(device_map=..., max_memory=...) yourself, or give accelab its directory"
        )
    stand_in = ModelSpec(
        name=type(model).__name__, task="image-classification", source=""
    )  # these checks read no files
    for module in (system, precision, quantization, compile_):
        module.check(plan, stand_in, device)
    runnable = Runnable(model=model, processor=processor, device=device, task="", plan=plan)
    try:
        system.apply(runnable, plan)
        if plan.attention != "default":
            setter = getattr(model, "set_attn_implementation", None)
            if setter is None:
                raise Unsupported(
                    f"attention={plan.attention} needs a transformers model; "
                    f"{type(model).__name__} is a custom nn.Module"
                )
            setter(plan.attention)
        dtype = precision.load_kwargs(plan)["dtype"]
        if dtype != torch.float32:
            runnable.model = model.to(dtype)
        _accelerate(runnable, plan)
    except BaseException:
        runnable.close()
        raise
    return runnable


def _notes(plan: Plan, runnable: Runnable) -> list[str]:
    notes = []
    if runnable.placement:
        devices = sorted(set(runnable.placement.values()))
        notes.append(f"layers placed on {', '.join(devices)}")
    return notes
