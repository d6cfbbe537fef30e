"""Precision: autocast through accelerate, a cast of the weights at load time, or fp8.

- `*-weights`: `from_pretrained(dtype=...)`; every matmul then runs in that dtype.
- `*-autocast`: `Accelerator(mixed_precision=...)` + `prepare_model`, which rewrites
  `model.forward` under `torch.autocast` (generate calls forward, so it is covered too) and
  casts the outputs back to fp32. The weights stay fp32.
- `fp8`: accelerate's fp8 (torchao Float8Linear, TransformerEngine or MS-AMP) on top of bf16
  autocast; Hopper/Ada GPUs only.

accelerate's state is a process singleton: one precision per process (accelab runs each
plan in its own child process).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from typing import Any

import torch

from accelab import cpu
from accelab.catalog.spec import ModelSpec
from accelab.plan.plan import Plan
from accelab.plan.runtime import Runnable, Unsupported

log = logging.getLogger(__name__)

_WEIGHT_DTYPES = {"bf16-weights": torch.bfloat16, "fp16-weights": torch.float16}
_AUTOCAST = {"bf16-autocast": "bf16", "fp16-autocast": "fp16", "fp8": "fp8"}
# accelerate 1.15 picks the first installed of these for mixed_precision="fp8"
_FP8_BACKENDS = {"torchao": "torchao", "transformer_engine": "TransformerEngine", "msamp": "MS-AMP"}
FP8_MIN_CAPABILITY = (8, 9)  # Ada Lovelace / Hopper

_NO_NATIVE_FP16_AUTOCAST_ON_CPU = (
    "accelerate's fp16 autocast is a no-op on CPU (native_amp is False): the model would run in fp32"
)


def check(plan: Plan, spec: ModelSpec, device: torch.device) -> None:
    if plan.precision == "fp16-autocast" and device.type == "cpu":
        raise Unsupported(_NO_NATIVE_FP16_AUTOCAST_ON_CPU)
    if plan.precision in ("bf16-autocast", "bf16-weights") and device.type == "cuda":
        if not torch.cuda.is_bf16_supported(including_emulation=False):
            name = torch.cuda.get_device_name(device)
            raise Unsupported(f"{name} has no native bf16 (needs compute capability 8.0+)")
    if plan.precision == "fp8":
        _check_fp8(device)


def _check_fp8(device: torch.device) -> None:
    if device.type != "cuda":
        raise Unsupported("fp8 needs a CUDA GPU with compute capability 8.9 or newer (Ada, Hopper); this run is on CPU")
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        # accelerate would silently fall back to fp16 here (it only logs a warning)
        raise Unsupported(
            f"fp8 needs compute capability 8.9 or newer; {torch.cuda.get_device_name(device)} has "
            f"{capability[0]}.{capability[1]} (accelerate would silently run fp16 instead)"
        )
    if fp8_backend() is None:
        raise Unsupported(
            "fp8 through accelerate needs one of torchao, transformer_engine or ms-amp installed; none is"
        )


def fp8_backend() -> str | None:
    """The fp8 backend accelerate will use: the first installed of torchao, TE, MS-AMP."""
    for module, name in _FP8_BACKENDS.items():
        if importlib.util.find_spec(module) is not None:
            return name
    return None


def load_kwargs(plan: Plan) -> dict:
    return {"dtype": _WEIGHT_DTYPES.get(plan.precision, torch.float32)}


def apply(runnable: Runnable, plan: Plan) -> None:
    """Wrap the model's forward in accelerate's autocast; add notes on slow dtypes on CPU."""
    if plan.precision in _WEIGHT_DTYPES:
        note = _cpu_dtype_note(plan.precision) if runnable.device.type == "cpu" else None
        if note:
            runnable.notes.append(note)
        return
    if plan.precision not in _AUTOCAST:
        return
    mixed_precision = _AUTOCAST[plan.precision]
    accelerator = _accelerator(mixed_precision, runnable.device)
    if not accelerator.native_amp:
        # the check above should have caught it; this is accelerate's own verdict
        raise Unsupported(
            f"accelerate's {mixed_precision} autocast is a no-op on {runnable.device.type} "
            "(native_amp is False): the model would run in fp32"
        )
    if mixed_precision == "fp8":
        # the fp8 layer swap happens in prepare(), not prepare_model(); placement is already done
        runnable.model = accelerator.prepare(runnable.model, device_placement=[False])
        runnable.notes.append(f"fp8 via accelerate ({fp8_backend()}) over bf16 autocast")
    else:
        runnable.model = accelerator.prepare_model(runnable.model, device_placement=False, evaluation_mode=True)
        runnable.notes.append(f"{mixed_precision} autocast via accelerate (weights stay fp32)")
        if runnable.device.type == "cpu":
            note = _cpu_dtype_note(plan.precision)
            if note:
                runnable.notes.append(note)
    log.info("%s: forward wrapped in %s autocast", plan.precision, mixed_precision)


class PrecisionConflict(RuntimeError):
    """accelerate's state, a process singleton, already holds another precision (or device)."""


def _accelerator(mixed_precision: str, device: torch.device) -> Any:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, is_initialized
    from accelerate.utils import DistributedType

    cpu = device.type == "cpu"
    if is_initialized():  # what accelerate would refuse, asked of its state rather than read from its error text
        state = AcceleratorState()
        held = state.mixed_precision
        if (cpu and state.device.type != "cpu") or (
            held != mixed_precision and state.distributed_type != DistributedType.DEEPSPEED
        ):
            raise PrecisionConflict(
                f"accelerate's state already holds mixed_precision={held!r} on {state.device} in this process "
                f"(asked: {mixed_precision!r} on {device}); run each precision in its own process"
            )
    return Accelerator(mixed_precision=mixed_precision, cpu=cpu)


def _cpu_dtype_note(precision: str) -> str | None:
    """Why a half-precision run may be slower on this CPU; None when the CPU has native support
    (torch's view of the CPU and accelab's, which ACCELAB_CPU_ISA may cap: `accelab.cpu`)."""
    if precision.startswith("bf16"):
        if (_cpu_flag("_is_avx512_bf16_supported") or _cpu_flag("_is_amx_tile_supported")) and _native(cpu.native_bf16):
            return None
        return "bf16 on a CPU without AVX512-BF16 or AMX: matmuls are emulated, expect much slower than fp32"
    if precision.startswith("fp16"):
        if (_cpu_flag("_is_amx_fp16_supported") or cpu.has("avx512_fp16")) and _native(cpu.native_fp16):
            return None
        return "fp16 on a CPU without AVX512-FP16 or AMX-FP16: matmuls are emulated, expect much slower than fp32"
    return None


def _native(flags_say: Callable[[], bool]) -> bool:
    # where there is no /proc/cpuinfo (macOS), torch's own probe decides alone
    return flags_say() or not cpu.host_flags()


def _cpu_flag(name: str) -> bool:
    probe = getattr(torch.cpu, name, None)  # private helpers, present in torch >= 2.3
    try:
        return bool(probe()) if probe is not None else False
    except RuntimeError:
        return False
