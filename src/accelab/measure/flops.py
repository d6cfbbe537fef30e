"""FLOPs, weight bytes and the roofline: how far a measured number is from the physical limit.

Compute-bound work (a batched forward) is judged by MFU: achieved FLOP/s over the measured
peak matmul FLOP/s. Bandwidth-bound work (decoding one token at batch 1 reads every weight
once) is judged by steps/s over the bandwidth bound, measured read bandwidth / bytes read per
step. The helpers here are pure arithmetic; the peaks come from `hardware.hardware_limits`.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Iterable

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

try:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
except ImportError:  # private helper; its contract is "has __tensor_flatten__"

    def is_traceable_wrapper_subclass(t: object) -> bool:
        return hasattr(t, "__tensor_flatten__") and type(t) not in (torch.Tensor, torch.nn.Parameter)


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


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers a forward reads, as stored.

    Quantized tensor subclasses (torchao) count their inner tensors (int8 data + scales + ...),
    not the logical dtype they pretend to be. Tensors sharing storage (tied embeddings, views
    of one fused weight) count the bytes of that storage they cover, once."""
    spans: dict[tuple[str, int], list[tuple[int, int]]] = defaultdict(list)
    unshared = 0
    for tensor in _leaf_tensors(_unique(model)):
        key, span = _storage_span(tensor)
        if key is None:
            unshared += span[1] - span[0]
        else:
            spans[key].append(span)
    return unshared + sum(_union_length(s) for s in spans.values())


def _unique(model: torch.nn.Module) -> Iterable[torch.Tensor]:
    # remove_duplicate drops the same Parameter object registered twice; shared storage
    # under different objects is handled by _storage_span.
    yield from model.parameters()
    yield from model.buffers()


def _leaf_tensors(tensors: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]:
    """Plain tensors; a wrapper subclass is replaced by its inner tensors, recursively."""
    for tensor in tensors:
        if is_traceable_wrapper_subclass(tensor):
            names, _ = tensor.__tensor_flatten__()
            yield from _leaf_tensors(getattr(tensor, name) for name in names)
        else:
            yield tensor


def _storage_span(tensor: torch.Tensor) -> tuple[tuple[str, int] | None, tuple[int, int]]:
    """(storage key, [start, end) bytes in that storage); key None when it has no real storage
    (meta tensors, exotic subclasses): then the span is just numel * element_size."""
    size = tensor.element_size()
    try:
        if tensor.is_meta:
            raise RuntimeError("meta tensors have no storage")
        ptr = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None, (0, tensor.numel() * size)
    if tensor.numel() == 0 or ptr == 0:
        return None, (0, 0)
    # Elements reachable from the first one: 1 + sum((dim - 1) * stride); stride 0 (expand)
    # reads the same memory again, and counts once.
    extent = 1 + sum((dim - 1) * abs(stride) for dim, stride in zip(tensor.shape, tensor.stride()))
    start = tensor.storage_offset() * size
    return (str(tensor.device), ptr), (start, start + extent * size)


def _union_length(spans: list[tuple[int, int]]) -> int:
    total, reach = 0, 0
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


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
