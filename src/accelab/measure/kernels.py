"""The kernels behind the peak FLOP/s and the memory bandwidth: those that models run.

A peak measured on a kernel the model does not take is not a limit of the model (a square
bf16 `torch.mm` on a CPU without AMX runs a slow reference path, while a model's Linear under
autocast runs oneDNN's bf16 GEMM: the MFU came out at 1225%). So each compute path ("fp32",
"bf16" weights, "bf16-autocast", and on CUDA "tf32", "fp16", "fp16-autocast") is timed on:
- `F.linear` at transformer shapes (tokens x hidden -> 4 x hidden and back),
- `F.conv2d` 3x3 and 1x1, in NCHW and channels_last,
- a square matmul,
and its peak is the best of them. A model's achieved FLOP/s is then below it by construction,
up to shapes none of these cover; bench re-measures when one is not (see benchmark.engine).

Bandwidth is STREAM's idea over arrays of several times the last-level cache: a read (sum), a
copy and a triad (a = b + s*c), at the run's thread count; the figure is the best of the three
(the most bytes per second this machine was seen to move), with the kernel that gave it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

CPU_CALL_TARGET_S = 0.025  # a CPU kernel grows (or shrinks) until one call takes about this long
CUDA_INNER = 10  # calls between two CUDA events, to hide launch latency
MIN_STREAM_BYTES = 256 * 2**20
CUDA_STREAM_BYTES = 2 * 2**30

PATHS_CPU = ("fp32", "bf16", "bf16-autocast")
PATHS_CUDA = ("fp32", "tf32", "bf16", "fp16", "bf16-autocast", "fp16-autocast")


@dataclass(frozen=True, slots=True)
class Rate:
    value: float  # FLOP/s or bytes/s
    kernel: str  # which kernel reached it, e.g. "linear 512x768->3072"


# -- timing -------------------------------------------------------------------------------------
def best_seconds(fn: Callable[[], Any], device: torch.device, *, repeats: int, inner: int = 1) -> float:
    """Best (minimum) seconds per call after one untimed warm-up: a limit is what the machine CAN do."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            with torch.cuda.device(device):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(inner):
                    fn()
                end.record()
                end.synchronize()  # note: a CPU-GPU sync point, once per timing
            seconds = start.elapsed_time(end) / 1000
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            seconds = time.perf_counter() - t0
        best = min(best, seconds / inner)
    return best


# -- compute paths -----------------------------------------------------------------------------
def _path_setup(path: str, device: torch.device) -> tuple[torch.dtype, Any]:
    """(the tensors' dtype, a context manager) for a compute path."""
    if path in ("fp32", "tf32"):
        return torch.float32, nullcontext
    if path in ("bf16", "fp16"):
        return (torch.bfloat16 if path == "bf16" else torch.float16), nullcontext
    if path in ("bf16-autocast", "fp16-autocast"):
        dtype = torch.bfloat16 if path.startswith("bf16") else torch.float16
        return torch.float32, (lambda: torch.autocast(device.type, dtype=dtype))
    raise ValueError(f"path={path!r} is not one of {', '.join(PATHS_CUDA)}")


def _linear(m: int, k: int, n: int) -> Callable[[torch.dtype, torch.device], tuple[Callable[[], Any], float, str]]:
    def build(dtype: torch.dtype, device: torch.device) -> tuple[Callable[[], Any], float, str]:
        x = torch.randn(m, k, device=device).to(dtype)
        w = torch.randn(n, k, device=device).to(dtype)
        return (lambda: F.linear(x, w)), 2.0 * m * k * n, f"linear {m}x{k}->{n}"

    return build


def _conv(batch: int, channels: int, size: int, kernel: int, channels_last: bool):
    def build(dtype: torch.dtype, device: torch.device) -> tuple[Callable[[], Any], float, str]:
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        x = torch.randn(batch, channels, size, size, device=device).to(dtype).to(memory_format=fmt)
        w = torch.randn(channels, channels, kernel, kernel, device=device).to(dtype).to(memory_format=fmt)
        flops = 2.0 * batch * channels * size * size * channels * kernel * kernel  # padding keeps the size
        layout = "channels_last" if channels_last else "NCHW"
        return (
            (lambda: F.conv2d(x, w, padding=kernel // 2)),
            flops,
            f"conv{kernel}x{kernel} {layout} {channels}ch {size}px",
        )

    return build


def _matmul(n: int):
    def build(dtype: torch.dtype, device: torch.device) -> tuple[Callable[[], Any], float, str]:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        return (lambda: torch.mm(a, b)), 2.0 * n**3, f"matmul {n}"

    return build


@contextmanager
def cuda_tf32(enabled: bool) -> Iterator[None]:
    """TF32 for CUDA fp32 matmuls on or off inside the block; restores the exact previous value
    (restoring another value, e.g. "none", makes torch refuse later reads of `allow_tf32`)."""
    matmul = torch.backends.cuda.matmul
    try:
        old: Any = matmul.fp32_precision  # torch >= 2.9
        value: str | bool = "tf32" if enabled else "ieee"
        name = "fp32_precision"
    except (AttributeError, RuntimeError):
        old = matmul.allow_tf32
        name, value = "allow_tf32", enabled
    setattr(matmul, name, value)
    try:
        yield
    finally:
        setattr(matmul, name, old)


def _kernels(device: torch.device, scale: int) -> list[Callable]:
    """The kernels, at sizes scaled down by `scale` (a power of two) for a slow path."""
    if device.type == "cuda":
        return [_matmul(8192), _linear(8192, 4096, 16384), _linear(4096, 4096, 4096), _conv(64, 256, 56, 3, True)]
    rows = max(8, 512 // scale)
    return [
        _linear(rows, 768, 3072),
        _linear(rows, 3072, 768),
        _linear(rows, 384, 1536),
        _conv(max(1, 8 // scale), 64, 56, 3, False),
        _conv(max(1, 8 // scale), 64, 56, 3, True),
        _conv(max(1, 8 // scale), 256, 28, 1, True),
        _matmul(max(128, 1024 // scale)),
    ]


def peak_flops(path: str, device: torch.device, *, repeats: int = 3) -> Rate:
    """The best FLOP/s of `path` over the kernels models run (see the module docstring)."""
    dtype, context = _path_setup(path, device)
    tf32 = cuda_tf32(path == "tf32") if device.type == "cuda" else nullcontext()
    best = Rate(0.0, "")
    with tf32, context():
        scale = 1 if device.type == "cuda" else _cpu_scale(dtype, device)
        for build in _kernels(device, scale):
            try:
                fn, flops, name = build(dtype, device)
                seconds = best_seconds(fn, device, repeats=repeats, inner=CUDA_INNER if device.type == "cuda" else 1)
            except RuntimeError as err:  # a kernel this dtype has no implementation of here
                log.info("peak %s: %s skipped (%s)", path, build, err)
                continue
            if flops / seconds > best.value:
                best = Rate(flops / seconds, name)
    log.info("peak %s on %s: %.1f GFLOP/s (%s)", path, device, best.value / 1e9, best.kernel)
    return best


def _cpu_scale(dtype: torch.dtype, device: torch.device) -> int:
    """How much to shrink the CPU kernels so that one call of the largest stays near the target
    (bf16 without native support runs ~100x slower than fp32 on some CPUs)."""
    fn, _, _ = _linear(512, 768, 3072)(dtype, device)
    seconds = best_seconds(fn, device, repeats=1)
    scale = 1
    while seconds / scale > 4 * CPU_CALL_TARGET_S and scale < 64:
        scale *= 2
    return scale


# -- bandwidth ---------------------------------------------------------------------------------
def last_level_cache_bytes() -> int | None:
    """The largest CPU cache, from sysfs (Linux); None elsewhere."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip().upper()
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        try:
            sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
        except (ValueError, IndexError):
            continue
    return max(sizes) if sizes else None


def stream_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return CUDA_STREAM_BYTES
    llc = last_level_cache_bytes() or 0
    return max(MIN_STREAM_BYTES, 8 * llc)


def bandwidth(device: torch.device, *, nbytes: int | None = None, repeats: int = 8) -> Rate:
    """Bytes per second: the best of read (x.sum), copy (y = x) and triad (z = x + 2y) over
    arrays of `nbytes` each (8x the last-level cache, at least 256 MiB), counting the bytes each
    reads and writes as STREAM does (no write-allocate traffic)."""
    nbytes = nbytes or stream_bytes(device)
    n = nbytes // 4
    # ones, not empty: untouched pages could all map the kernel's shared zero page
    x = torch.ones(n, device=device)
    y = torch.ones(n, device=device)
    z = torch.empty(n, device=device)
    inner = CUDA_INNER if device.type == "cuda" else 1
    kernels: dict[str, tuple[Callable[[], Any], int]] = {
        "read": (x.sum, nbytes),
        "copy": (lambda: z.copy_(x), 2 * nbytes),
        "triad": (lambda: torch.add(x, y, alpha=2.0, out=z), 3 * nbytes),
    }
    best = Rate(0.0, "")
    for name, (fn, moved) in kernels.items():
        rate = moved / best_seconds(fn, device, repeats=repeats, inner=inner)
        log.info("bandwidth %s %s (%d MiB arrays): %.1f GB/s", device, name, nbytes >> 20, rate / 1e9)
        if rate > best.value:
            best = Rate(rate, f"{name}, {nbytes >> 20} MiB arrays")
    return best
