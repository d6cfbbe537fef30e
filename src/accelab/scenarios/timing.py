"""Device-aware timing of one call: CUDA events on GPUs, perf_counter on CPUs."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def call_timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """`timer(fn) -> seconds` for one call of fn, measured on the device that runs it."""
    if device.type != "cuda":

        def cpu_timer(fn: Callable[[], object]) -> float:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0

        return cpu_timer

    def cuda_timer(fn: Callable[[], object]) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()  # note: the one CPU-GPU sync point per call
        return start.elapsed_time(end) / 1000.0

    return cuda_timer
