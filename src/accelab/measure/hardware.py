"""This machine's physical limits, measured: peak matmul FLOP/s and memory read bandwidth, the
two denominators of every roofline figure accelab reports. Cached in
`cache_dir()/hardware.json`, keyed by the environment fingerprint, the device and the thread
count, because they take a second or two to measure and do not change between runs.

What each technique can do here is `accelab.measure.capabilities`, which reads these limits.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from accelab.measure.environment import environment, fingerprint
from accelab.paths import cache_dir

log = logging.getLogger(__name__)

CACHE_FILE = "hardware.json"

# A CPU matmul grows until one call takes this long (or reaches max size): big enough to reach
# the kernel's steady rate, small enough that a CPU without native bf16 (400x slower on some
# machines) stays under a second.
CPU_CALL_TARGET_S = 0.025
CPU_MAX_MATMUL = 2048
CUDA_MATMUL = 8192
CPU_READ_BYTES = 256 * 2**20  # larger than most L2s; some virtual CPUs report huge L3s
CUDA_READ_BYTES = 2 * 2**30
CUDA_INNER = 10  # calls between two CUDA events, to hide launch latency


@dataclass(frozen=True, kw_only=True, slots=True)
class HardwareLimits:
    """Measured limits of one device at one thread count.

    fp32_flops on CUDA is strict IEEE fp32 (TF32 off); tf32_flops is None on CPU.
    bandwidth_bytes_per_s is READ bandwidth (bytes read per second, see memory_bandwidth)."""

    device: str
    fp32_flops: float
    bf16_flops: float
    tf32_flops: float | None
    bandwidth_bytes_per_s: float
    threads: int
    measured_at: str  # ISO 8601, UTC
    fingerprint: str


# --- timing ------------------------------------------------------------------------------


def _best_seconds(fn: Callable[[], Any], device: torch.device, *, repeats: int, inner: int = 1) -> float:
    """Best (minimum) seconds per call of fn over `repeats` timings of `inner` calls each,
    after one untimed warm-up call. Min, not median: a limit is what the machine CAN do."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            # Events record on the current device's stream: make it the measured device's.
            with torch.cuda.device(device):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(inner):
                    fn()
                end.record()
                end.synchronize()  # note: CPU-GPU sync point, once per timing
            seconds = start.elapsed_time(end) / 1000
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            seconds = time.perf_counter() - t0
        best = min(best, seconds / inner)
    return best


def _resolve_device(device: str | torch.device) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} asked for CUDA, but torch sees no GPU here; use device='cpu'")
        return torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
    if dev.type != "cpu":
        raise ValueError(f"device={device!r} is not supported: use 'cpu' or 'cuda[:N]'")
    return dev


@contextmanager
def _cuda_tf32(enabled: bool) -> Iterator[None]:
    """TF32 for CUDA fp32 matmuls on or off inside the block; restores the exact previous value
    (restoring another value, e.g. "none", makes torch refuse later reads of `allow_tf32`)."""
    matmul = torch.backends.cuda.matmul
    try:
        old: Any = matmul.fp32_precision  # torch >= 2.9
        name, value = "fp32_precision", "tf32" if enabled else "ieee"
    except (AttributeError, RuntimeError):
        old = matmul.allow_tf32
        name, value = "allow_tf32", enabled
    setattr(matmul, name, value)
    try:
        yield
    finally:
        setattr(matmul, name, old)


# --- micro-benchmarks --------------------------------------------------------------------


def peak_matmul_flops(
    device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, *, repeats: int = 5
) -> float:
    """FLOP/s of a square matmul (2*n^3 FLOPs), best of `repeats`.

    CUDA: n=8192, timed with CUDA events over 10 calls. CPU: n doubles from 256 until one
    call takes >= 25 ms or n reaches 2048, so slow dtypes (bf16 without native support) stay
    fast to measure; at the current torch thread count. CUDA fp32 uses the current TF32
    setting (see hardware_limits for explicit IEEE / TF32 figures)."""
    dev = _resolve_device(device)
    if dev.type == "cuda":
        n, inner = CUDA_MATMUL, CUDA_INNER
    else:
        n, inner = _calibrate_cpu_size(dtype), 1
    a = torch.randn(n, n, device=dev, dtype=torch.float32).to(dtype)
    b = torch.randn(n, n, device=dev, dtype=torch.float32).to(dtype)
    seconds = _best_seconds(lambda: torch.mm(a, b), dev, repeats=repeats, inner=inner)
    flops = 2 * n**3 / seconds
    log.info("matmul %s %s n=%d: %.1f GFLOP/s", dev, dtype, n, flops / 1e9)
    return flops


def _calibrate_cpu_size(dtype: torch.dtype) -> int:
    n = 256
    while n < CPU_MAX_MATMUL:
        a = torch.randn(n, n).to(dtype)
        if _best_seconds(lambda: torch.mm(a, a), torch.device("cpu"), repeats=1) >= CPU_CALL_TARGET_S:
            break
        n *= 2
    return n


def memory_bandwidth(device: str | torch.device = "cpu", *, nbytes: int | None = None, repeats: int = 10) -> float:
    """READ bandwidth in bytes/s: `x.sum()` over an fp32 tensor of `nbytes` (256 MiB on CPU,
    2 GiB on CUDA), counting only the nbytes read per call (the 4-byte result is ignored).

    Read bandwidth is the roofline for decoding, which streams the weights once per token. A
    copy would move 2*nbytes (read + write), and on CPU write-allocate adds a third pass that
    no counter sees; the sum avoids that ambiguity."""
    dev = _resolve_device(device)
    nbytes = nbytes or (CUDA_READ_BYTES if dev.type == "cuda" else CPU_READ_BYTES)
    # ones, not empty: untouched pages could all map the kernel's shared zero page.
    x = torch.ones(nbytes // 4, device=dev, dtype=torch.float32)
    inner = CUDA_INNER if dev.type == "cuda" else 1
    seconds = _best_seconds(lambda: x.sum(), dev, repeats=repeats, inner=inner)
    bandwidth = x.nbytes / seconds
    log.info("read bandwidth %s (%d MiB): %.1f GB/s", dev, x.nbytes >> 20, bandwidth / 1e9)
    return bandwidth


# --- the cache ---------------------------------------------------------------------------


def hardware_limits(device: str | torch.device = "cpu", refresh: bool = False) -> HardwareLimits:
    """Peak fp32/bf16 (and TF32 on CUDA) matmul FLOP/s and read bandwidth of `device`, from
    the cache unless `refresh` or this machine/software/thread count has not been measured."""
    dev = _resolve_device(device)
    threads = torch.get_num_threads()
    fp = fingerprint(environment())
    if not refresh and (limits := cached_limits(dev, _fingerprint=fp)) is not None:
        return limits
    limits = _measure(dev, threads, fp)
    cache = _read_cache()
    cache[_cache_key(fp, dev, threads)] = asdict(limits)
    _write_cache(cache)
    return limits


def cached_limits(device: str | torch.device = "cpu", *, _fingerprint: str | None = None) -> HardwareLimits | None:
    """The limits measured earlier for this machine, software and thread count, or None (never measures)."""
    dev = _resolve_device(device)
    key = _cache_key(_fingerprint or fingerprint(environment()), dev, torch.get_num_threads())
    entry = _read_cache().get(key)
    if entry is None:
        return None
    try:
        return HardwareLimits(**entry)
    except TypeError:  # written by another accelab version
        log.info("hardware cache entry %s is stale", key)
        return None


def _cache_key(fp: str, dev: torch.device, threads: int) -> str:
    return f"{fp}|{dev}|threads={threads}"


def _measure(dev: torch.device, threads: int, fp: str) -> HardwareLimits:
    log.info("measuring %s limits at %d threads (cached afterwards)", dev, threads)
    tf32 = None
    if dev.type == "cuda":
        with _cuda_tf32(False):
            fp32 = peak_matmul_flops(dev, torch.float32)
        with _cuda_tf32(True):
            tf32 = peak_matmul_flops(dev, torch.float32)
    else:
        fp32 = peak_matmul_flops(dev, torch.float32)
    return HardwareLimits(
        device=str(dev),
        fp32_flops=fp32,
        bf16_flops=peak_matmul_flops(dev, torch.bfloat16),
        tf32_flops=tf32,
        bandwidth_bytes_per_s=memory_bandwidth(dev),
        threads=threads,
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        fingerprint=fp,
    )


def _cache_path() -> Path:
    return cache_dir() / CACHE_FILE


def _read_cache() -> dict[str, Any]:
    try:
        with open(_cache_path()) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(cache: dict[str, Any]) -> None:
    # Atomic replace: another accelab process may be reading the file right now.
    path = _cache_path()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".hardware-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(cache, f, indent=2, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
