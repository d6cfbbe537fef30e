"""FLOPs and the roofline: how far a measured number is from the physical limit.

Compute-bound work (a batched forward) is judged by MFU: achieved FLOP/s over the measured
peak matmul FLOP/s. Bandwidth-bound work (decoding one token at batch 1 reads every weight
once) is judged by steps/s over the bandwidth bound, measured read bandwidth / bytes read per
step. The helpers here are pure arithmetic; the peaks come from `hardware.hardware_limits`, the
bytes of the weights from `accelab.catalog.facts.weight_bytes`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count


def count_flops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """FLOPs of one call fn(*args, **kwargs), run once under no_grad.

    Counts matmuls, convolutions and attention (torch's FlopCounterMode: 2 FLOPs per
    multiply-add, plus the CPU fused attention kernel it has no formula for); element-wise ops
    count 0. Forward + backward is about 3x forward."""
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=_EXTRA_FORMULAS) as counter:
        fn(*args, **kwargs)
    return int(counter.get_total_flops())


def _cpu_sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    # torch counts its CUDA flash/efficient attention kernels but not the CPU one, which is
    # what scaled_dot_product_attention runs on CPU: without this a BERT forward misses
    # its QK^T and AV matmuls. Like torch's own formula, causal masking is not discounted.
    return sdpa_flop_count(query_shape, key_shape, value_shape)


_EXTRA_FORMULAS: dict[Any, Any] = {}
if hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
    _EXTRA_FORMULAS[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu] = _cpu_sdpa_flops


# --- roofline ---------------------------------------------------------------------------


def mfu(flops_per_call: float, seconds_per_call: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: (flops_per_call / seconds_per_call) / peak_flops, in [0, 1]
    when the peak is right (above 1 means the peak was measured under other conditions)."""
    _check_positive(seconds_per_call=seconds_per_call, peak_flops=peak_flops)
    return flops_per_call / seconds_per_call / peak_flops


def decode_roofline(
    weight_bytes: float, step_seconds: float, bandwidth: float, *, extra_bytes_per_step: float = 0
) -> dict[str, float]:
    """How close one decode step comes to the memory-bandwidth limit.

    Each step reads `weight_bytes` (+ `extra_bytes_per_step`, e.g. the KV cache) at
    `bandwidth` bytes/s, so steps/s can be at most bandwidth / bytes_per_step. Returns
    bytes_per_step, bound_steps_per_s, achieved_steps_per_s, fraction (achieved / bound) and
    achieved_bandwidth (bytes_per_step * achieved steps/s)."""
    bytes_per_step = weight_bytes + extra_bytes_per_step
    _check_positive(bytes_per_step=bytes_per_step, step_seconds=step_seconds, bandwidth=bandwidth)
    bound = bandwidth / bytes_per_step
    achieved = 1.0 / step_seconds
    return {
        "bytes_per_step": float(bytes_per_step),
        "bound_steps_per_s": bound,
        "achieved_steps_per_s": achieved,
        "fraction": achieved / bound,
        "achieved_bandwidth": bytes_per_step * achieved,
    }


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name}={value} must be > 0")
