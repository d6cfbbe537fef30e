"""The server process's own gauges: its resident memory, and GPU memory per device where torch
sees a CUDA GPU (accelab.serve.metrics registers them)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import psutil
from prometheus_client import CollectorRegistry, Gauge


def rss_bytes() -> float:
    """Resident memory of this process (NaN where it cannot be read: a scrape never fails over it)."""
    try:
        return float(psutil.Process(os.getpid()).memory_info().rss)
    except Exception:  # noqa: BLE001 - a scrape must not fail over one gauge
        return float("nan")


def gpu_gauges(registry: CollectorRegistry, cuda: Any = None) -> Gauge | None:
    """GPU memory, per device, only where torch sees a CUDA GPU (`cuda`: torch.cuda, or what
    answers like it)."""
    if cuda is None:
        try:
            import torch
        except ImportError:  # pragma: no cover
            return None
        cuda = torch.cuda
    if not cuda.is_available():
        return None
    allocated = Gauge(
        "accelab_gpu_memory_allocated_bytes", "torch.cuda.memory_allocated per device.", ["device"], registry=registry
    )
    reserved = Gauge(
        "accelab_gpu_memory_reserved_bytes", "torch.cuda.memory_reserved per device.", ["device"], registry=registry
    )
    peak = Gauge(
        "accelab_gpu_memory_peak_bytes", "torch.cuda.max_memory_allocated per device.", ["device"], registry=registry
    )
    for index in range(cuda.device_count()):
        allocated.labels(device=str(index)).set_function(_of_device(cuda.memory_allocated, index))
        reserved.labels(device=str(index)).set_function(_of_device(cuda.memory_reserved, index))
        peak.labels(device=str(index)).set_function(_of_device(cuda.max_memory_allocated, index))
    return allocated


def _of_device(read: Callable[[int], float], index: int) -> Callable[[], float]:
    return lambda: read(index)
