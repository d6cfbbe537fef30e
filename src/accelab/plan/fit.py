"""Does a plan fit this machine? Its model's memory, counted before anything loads, against the
memory the machine has available.

The weights are counted from the model's shapes (its skeleton on the meta device: no weights
read) at the plan's precision: a Linear layer the plan quantizes to int8 holds a byte a weight and
a float32 scale a row; everything else holds the plan's dtype (a tied embedding and head once).
To them go the KV pool a server will allocate (`kv_bytes`, where the caller knows it) and an
overhead: the Python runtime and the activations, 1 GiB and 5% of the weights (an estimate, said
as one). Available memory is the kernel's MemAvailable, or less where the process's cgroup is
limited; ACCELAB_AVAILABLE_MEMORY (a size: 8GiB, 6000MB) replaces it, to plan for a share of
a machine (and, in the tests, to stand for a machine too small for the model).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from accelab.catalog.facts import text_config
from accelab.catalog.spec import ModelSpec
from accelab.plan.plan import Plan
from accelab.plan.quantized_load import held_on_cpu, skeleton
from accelab.plan.runtime import Unsupported
from accelab.plan.techniques import precision, quantization
from accelab.units import parse_size_mib

log = logging.getLogger(__name__)

AVAILABLE_ENV = "ACCELAB_AVAILABLE_MEMORY"
OVERHEAD_FIXED = 1 << 30
OVERHEAD_SHARE = 0.05
_QUANTIZED_BYTES = {"int8-weight": 1.0, "int8-dynamic": 1.0, "int4-weight": 0.5}


@dataclass(frozen=True, slots=True)
class Footprint:
    """The memory a plan needs, in bytes, against what the machine has."""

    weights: int
    kv_pool: int
    overhead: int
    available: int
    precision: str

    @property
    def total(self) -> int:
        return self.weights + self.kv_pool + self.overhead

    @property
    def fits(self) -> bool:
        return self.total <= self.available

    def describe(self) -> str:
        kv = f" + KV pool {_gb(self.kv_pool)}" if self.kv_pool else ""
        return (
            f"weights {_gb(self.weights)} ({self.precision}){kv} + overhead {_gb(self.overhead)} (estimated) "
            f"= {_gb(self.total)}, against {_gb(self.available)} available"
        )


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def weight_bytes(spec: ModelSpec, plan: Plan) -> int | None:
    """The bytes the plan's model holds in weights once loaded; None where its shapes cannot be
    read without loading it (a custom module, a GGUF file, remote code, no checkpoint here)."""

    if spec.custom or spec.gguf_file or spec.trust_remote_code or not (Path(spec.source) / "config.json").is_file():
        return None
    dtype = precision.load_kwargs(plan)["dtype"]
    try:
        model = skeleton(spec, dtype)
    except Exception as exc:  # noqa: BLE001 - a model transformers cannot build empty loads as before, unchecked
        log.info("%s: its weights could not be counted before loading (%s: %s)", spec.name, type(exc).__name__, exc)
        return None
    per_weight = _QUANTIZED_BYTES.get(plan.quantization)
    chosen = quantization.choose(model, plan) if per_weight else None
    seen: set[int] = set()
    total = 0.0
    for name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            if chosen is not None and pname == "weight" and chosen(module, name):
                total += param.numel() * per_weight + param.shape[0] * 4  # the values, a float32 scale a row
                continue
            if id(param) not in seen:
                seen.add(id(param))
                total += param.numel() * dtype.itemsize
    return int(total)


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int | None:
    """A token's keys and values over all layers of the language model `config` describes (a
    transformers config, or config.json as a dict), at `dtype`; None where it does not say."""

    text = text_config(config)
    get = text.get if isinstance(text, dict) else lambda key, default=None: getattr(text, key, default)
    layers, heads, hidden = get("num_hidden_layers"), get("num_attention_heads"), get("hidden_size")
    if not (layers and heads and hidden):
        return None
    kv_heads = get("num_key_value_heads") or heads
    head_dim = get("head_dim") or hidden // heads
    return 2 * layers * kv_heads * head_dim * dtype.itemsize


def kv_dtype(plan: Plan) -> torch.dtype:
    """The dtype the own engine keeps keys and values in under `plan`: its weights' (float32 for
    the int8 plans of float32 activations)."""

    return precision.load_kwargs(plan)["dtype"]


def available_bytes() -> int:
    """The memory this process may still take: MemAvailable, the cgroup's room if less, or the
    ACCELAB_AVAILABLE_MEMORY override."""

    given = os.environ.get(AVAILABLE_ENV)
    if given:
        return int(parse_size_mib(given, AVAILABLE_ENV) * (1 << 20))
    room = psutil.virtual_memory().available
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            room = min(room, int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return room


def footprint(spec: ModelSpec, plan: Plan, *, kv_bytes: int = 0) -> Footprint | None:
    """What `plan` on `spec` needs and what there is; None where the weights cannot be counted."""
    weights = weight_bytes(spec, plan)
    if weights is None:
        return None
    overhead = OVERHEAD_FIXED + int(OVERHEAD_SHARE * weights)
    return Footprint(
        weights=weights, kv_pool=kv_bytes, overhead=overhead, available=available_bytes(), precision=_precision(plan)
    )


def _precision(plan: Plan) -> str:

    dtype = str(precision.load_kwargs(plan)["dtype"]).removeprefix("torch.")
    return dtype if plan.quantization == "none" else f"{plan.quantization} layers, the rest {dtype}"


def check(spec: ModelSpec, plan: Plan, device: torch.device, *, kv_bytes: int = 0) -> None:
    """Raise Unsupported, with the figures, when a torch plan on the CPU cannot fit this machine."""

    if not held_on_cpu(plan, device):
        return
    need = footprint(spec, plan, kv_bytes=kv_bytes)
    if need is not None and not need.fits:
        raise Unsupported(
            f"{spec.name} under the plan {plan.name} does not fit this machine's memory: {need.describe()}. "
            "Choose a narrower plan (int8-weight holds a byte a weight, bf16 two), a smaller --max-batch-size "
            f"or --kv-cache-tokens, or set {AVAILABLE_ENV} if more will be free"
        )
