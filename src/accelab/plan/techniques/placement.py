"""Placement: one device, or accelerate's device map over GPUs, CPU and disk.

- `auto` / `cpu` / `cuda`: the whole model on one device (`model.to`).
- `device-map`: `from_pretrained(device_map="auto")` spreads layers over the GPUs (and CPU
  when they are full), within `max_memory` when the plan gives one.
- `cpu-offload` (GPU runs only): the GPU holds part of the weights, the rest stays in CPU
  memory and is copied in per call.
- `disk-offload`: part of the weights stays on disk and is read per call. On CPU this is
  the way to run a model larger than RAM. With safetensors checkpoints transformers reads
  the offloaded weights straight from the checkpoint; other formats are written to the
  offload folder first.

Without `max_memory`, offload keeps half of the weights in the fast tier so the run shows
what offloading costs; the model's size comes from its config (meta device, no data).
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from typing import Any

import psutil
import torch

from accelab.catalog.facts import weight_bytes
from accelab.catalog.spec import ModelSpec
from accelab.plan.plan import Plan, parse_max_memory
from accelab.plan.runtime import Runnable, Unsupported
from accelab.plan.techniques import _model_info, precision

log = logging.getLogger(__name__)

_MAPPED = ("device-map", "cpu-offload", "disk-offload")
# Offload folders made when the caller gave neither offload_dir nor an exit stack: they are
# deleted at interpreter exit (TemporaryDirectory's finalizer); one plan runs per process.
_PROCESS_LIFETIME_DIRS: list[tempfile.TemporaryDirectory] = []


def check(plan: Plan, spec: ModelSpec, device: torch.device) -> None:
    if plan.placement in _MAPPED:
        _model_info.needs_transformers(spec, f"placement={plan.placement} (a device map of from_pretrained)")
    if plan.placement == "cuda" and (device.type != "cuda" or not torch.cuda.is_available()):
        raise Unsupported("placement=cuda needs a CUDA GPU; this run is on CPU")
    if plan.placement == "cpu" and device.type != "cpu":
        raise Unsupported(f"placement=cpu conflicts with the run's device {device}; use --device cpu")
    if plan.placement == "cpu-offload" and device.type != "cuda":
        raise Unsupported(
            "CPU offload moves weights from a GPU to CPU memory; this run is already on CPU "
            "(placement=disk-offload spills weights to disk instead)"
        )
    if plan.placement == "device-map" and device.type != "cuda":
        raise Unsupported(
            "device-map spreads layers over GPUs; this run has none, so everything would stay on CPU "
            "(placement=disk-offload spills weights to disk instead)"
        )
    if plan.placement in _MAPPED and plan.max_memory is not None:
        _check_max_memory_devices(parse_max_memory(plan.max_memory))


def _check_max_memory_devices(max_memory: dict[str | int, str]) -> None:
    count = torch.cuda.device_count()
    missing = sorted(k for k in max_memory if isinstance(k, int) and k >= count)
    if missing:
        names = ", ".join(f"cuda:{k}" for k in missing)
        raise Unsupported(f"max_memory names {names}, but this machine has {count} GPU(s)")


def load_kwargs(
    plan: Plan,
    device: torch.device,
    offload_dir: str | None = None,
    *,
    spec: ModelSpec | None = None,
    exit_stack: contextlib.ExitStack | None = None,
) -> dict:
    """`from_pretrained` arguments for the plan's placement ({} for single-device plans).

    `spec` sizes the default memory budget of offload plans without `max_memory`;
    `exit_stack` (the Runnable's) deletes a temporary offload folder when the run closes.
    """
    if plan.placement not in _MAPPED:
        return {}
    kwargs: dict[str, Any] = {"device_map": "auto"}
    if plan.max_memory is not None:
        kwargs["max_memory"] = parse_max_memory(plan.max_memory)
    elif plan.placement != "device-map":
        kwargs["max_memory"] = _default_offload_memory(plan, device, spec)
    if plan.placement == "disk-offload" or "disk" in kwargs.get("max_memory", {}):
        kwargs["offload_folder"] = offload_dir or _temporary_dir(exit_stack)
    log.info("placement %s: %s", plan.placement, kwargs)
    return kwargs


def _default_offload_memory(plan: Plan, device: torch.device, spec: ModelSpec | None) -> dict[str | int, int]:
    """Half of the weights in the fast tier (the GPU, or RAM for disk offload on CPU)."""
    if spec is None:
        raise ValueError(
            f"placement={plan.placement} without max_memory needs the model to size its budget; "
            "set max_memory, e.g. max_memory=cpu=200MB"
        )
    half = max(model_bytes(spec, plan) // 2, 1)
    gpu = device.index or 0
    if plan.placement == "cpu-offload":
        return {gpu: half, "cpu": psutil.virtual_memory().available}
    if device.type == "cuda":  # disk offload on a GPU run: GPU, then disk
        return {gpu: half}
    return {"cpu": half}


def model_bytes(spec: ModelSpec, plan: Plan) -> int:
    """Size of the model's weights at the dtype the plan loads them in, from its config."""
    config = _model_info.load_config(spec)
    dtype = precision.load_kwargs(plan)["dtype"]
    model = _model_info.meta_model(spec, config, dtype) if config is not None else None
    if model is None:
        raise ValueError(f"cannot size {spec.name} from its config; set max_memory, e.g. max_memory=cpu=200MB")
    return weight_bytes(model)  # built at `dtype`: its tensors hold what loading will allocate


def _temporary_dir(exit_stack: contextlib.ExitStack | None) -> str:
    folder = tempfile.TemporaryDirectory(prefix="accelab-offload-")
    if exit_stack is not None:
        exit_stack.callback(folder.cleanup)
    else:
        _PROCESS_LIFETIME_DIRS.append(folder)
    return folder.name


def apply(runnable: Runnable, plan: Plan) -> None:
    """Move the model to the run's device, unless a device map already placed its layers (then
    `runnable.placement` says where each went)."""
    runnable.placement = describe(runnable.model)
    if runnable.placement:
        return  # accelerate's hooks move each layer's inputs and weights per call
    target = torch.device("cpu") if plan.placement == "cpu" else runnable.device
    runnable.model = runnable.model.to(target)


def describe(model: Any) -> dict[str, str] | None:
    """{module name: "cpu" | "disk" | "cuda:N"} where a device map placed layers, else None."""
    device_map = getattr(model, "hf_device_map", None)
    if not device_map:
        return None
    return {name: _device_name(where) for name, where in device_map.items()}


def _device_name(where: Any) -> str:
    if isinstance(where, int):
        return f"cuda:{where}"
    return str(where)
