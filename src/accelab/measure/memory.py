"""Peak memory and utilisation of a block of code, sampled by one background thread.

    with PeakMemorySampler(device="cuda") as sampler:
        model(**inputs)
    sampler.report.peak_rss_mb

CPU: the thread reads the process RSS every `interval` seconds (sleeping on an Event, never
spinning, so it does not steal a core from the measured code) and keeps the peak; CPU
utilisation comes from the process CPU time over the wall time of the block. CUDA: torch's
allocator peaks (reset on enter) plus NVML memory, utilisation and power, read by the same
thread. Sizes are MiB (2**20 bytes), named `_mb` as in the report.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import psutil

from accelab.measure.environment import available_cores
from accelab.measure.gpu import GpuSample, NvmlGpu

log = logging.getLogger(__name__)

MiB = 2**20
DEFAULT_INTERVAL_S = 0.005
NVML_INTERVAL_S = 0.05  # NVML queries cost ~0.1-1 ms each and its utilisation updates slowly


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryReport:
    """Peaks and utilisation over one sampled block; None where not applicable (no GPU)."""

    peak_rss_mb: float
    baseline_rss_mb: float  # RSS on entering the block
    cpu_util_percent: float  # process CPU time / wall time; 100 = one core busy
    cpu_util_fraction: float  # the same over the cores this process may use; 1.0 = all busy
    gpu_peak_allocated_mb: float | None  # torch.cuda.max_memory_allocated, reset on enter
    gpu_peak_reserved_mb: float | None  # the caching allocator's peak reservation
    nvml_used_mb: float | None  # peak NVML memory: this process's, or the device's (nvml_scope)
    nvml_scope: Literal["process", "device"] | None
    gpu_util_percent: float | None  # mean of the NVML samples
    power_w: float | None  # mean of the NVML samples
    samples: int  # RSS readings taken, including the ones on enter and exit
    seconds: float

    @property
    def peak_delta_mb(self) -> float:
        """How much the block added on top of what was resident before it."""
        return self.peak_rss_mb - self.baseline_rss_mb


class GpuProbe(Protocol):
    def sample(self) -> GpuSample: ...

    def close(self) -> None: ...


def process_rss_reader(include_children: bool = False, pid: int | None = None) -> Callable[[], int]:
    """A reader of the resident set size in bytes of `pid` (default: this process), plus its
    live children's when include_children (summed: shared pages are counted more than once)."""
    proc = psutil.Process(pid)

    def read() -> int:
        rss = proc.memory_info().rss
        if include_children:
            for child in proc.children(recursive=True):
                try:
                    rss += child.memory_info().rss
                except psutil.Error:  # exited between listing and reading
                    pass
        return rss

    return read


def process_cpu_seconds_reader(include_children: bool = False, pid: int | None = None) -> Callable[[], float]:
    """A reader of user+system CPU seconds of `pid`, plus its children's when asked (the live
    ones, and the exited ones the process has waited for)."""
    proc = psutil.Process(pid)

    def read() -> float:
        times = proc.cpu_times()
        seconds = times.user + times.system
        if include_children:
            seconds += times.children_user + times.children_system
            for child in proc.children(recursive=True):
                try:
                    child_times = child.cpu_times()
                except psutil.Error:
                    continue
                seconds += child_times.user + child_times.system
        return seconds

    return read


class PeakMemorySampler:
    """Context manager sampling RSS (and GPU telemetry) in one background thread.

    interval: seconds between RSS samples. device: "cpu", "cuda[:N]", or None for CUDA when
    torch has already initialised it (a CPU-only run never creates a CUDA context).
    rss_reader / cpu_seconds_reader / gpu: injectable for tests (bytes, seconds, GpuProbe).
    """

    def __init__(
        self,
        *,
        interval: float = DEFAULT_INTERVAL_S,
        include_children: bool = False,
        device: Any = None,
        rss_reader: Callable[[], int] | None = None,
        cpu_seconds_reader: Callable[[], float] | None = None,
        gpu: GpuProbe | None = None,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"PeakMemorySampler interval={interval} must be > 0 seconds (e.g. 0.005)")
        self._interval = interval
        self._read_rss = rss_reader or process_rss_reader(include_children)
        self._read_cpu = cpu_seconds_reader or process_cpu_seconds_reader(include_children)
        self._cuda = _cuda_device(device)
        self._gpu = gpu
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._report: MemoryReport | None = None
        # Written by the sampling thread only, between start() and join().
        self._peak = 0
        self._samples = 0
        self._gpu_samples: list[GpuSample] = []
        self._last_gpu = float("-inf")

    # --- context manager -------------------------------------------------------------------

    def __enter__(self) -> PeakMemorySampler:
        if self._thread is not None:
            raise RuntimeError("a PeakMemorySampler measures one block; create a new one for the next")
        if self._cuda is not None:
            import torch

            torch.cuda.synchronize(self._cuda)  # earlier work must not count in this block
            torch.cuda.reset_peak_memory_stats(self._cuda)
            if self._gpu is None:
                self._gpu = NvmlGpu(self._cuda.index or 0)
        self._baseline = self._read_rss()
        self._peak, self._samples = self._baseline, 1
        self._sample_gpu(force=True)
        self._cpu0, self._t0 = self._read_cpu(), time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="accelab-memory-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._cuda is not None:
                import torch

                torch.cuda.synchronize(self._cuda)  # note: sync point; the block's kernels finish here
            seconds = time.perf_counter() - self._t0
            cpu_seconds = self._read_cpu() - self._cpu0
        finally:
            self._stop.set()
            if self._thread is not None:  # started by __enter__
                self._thread.join()
        try:
            self._sample_rss()  # a block shorter than one interval still gets a reading at its end
            self._sample_gpu(force=True)
            self._report = self._build_report(seconds, cpu_seconds)
        finally:
            if self._gpu is not None:
                self._gpu.close()

    @property
    def report(self) -> MemoryReport:
        if self._report is None:
            raise RuntimeError("PeakMemorySampler.report is ready only after the `with` block exits")
        return self._report

    @property
    def running(self) -> bool:
        """True while the sampling thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    # --- sampling thread --------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._sample_rss()
            self._sample_gpu()

    def _sample_rss(self) -> None:
        self._peak = max(self._peak, self._read_rss())
        self._samples += 1

    def _sample_gpu(self, force: bool = False) -> None:
        if self._gpu is None:
            return
        now = time.perf_counter()
        if force or now - self._last_gpu >= NVML_INTERVAL_S:
            self._last_gpu = now
            self._gpu_samples.append(self._gpu.sample())

    # --- report -----------------------------------------------------------------------------

    def _build_report(self, seconds: float, cpu_seconds: float) -> MemoryReport:
        cpu_percent = 100.0 * cpu_seconds / seconds if seconds > 0 else 0.0
        allocated = reserved = None
        if self._cuda is not None:
            import torch

            allocated = torch.cuda.max_memory_allocated(self._cuda) / MiB
            reserved = torch.cuda.max_memory_reserved(self._cuda) / MiB
        nvml_used, scope = _nvml_peak(self._gpu_samples)
        return MemoryReport(
            peak_rss_mb=self._peak / MiB,
            baseline_rss_mb=self._baseline / MiB,
            cpu_util_percent=cpu_percent,
            cpu_util_fraction=cpu_percent / 100.0 / available_cores(),
            gpu_peak_allocated_mb=allocated,
            gpu_peak_reserved_mb=reserved,
            nvml_used_mb=nvml_used,
            nvml_scope=scope,
            gpu_util_percent=_mean(s.util_percent for s in self._gpu_samples),
            power_w=_mean(s.power_w for s in self._gpu_samples),
            samples=self._samples,
            seconds=seconds,
        )


def _cuda_device(device: Any) -> Any:
    """The torch.device to watch on CUDA, or None for a CPU-only block."""
    import torch

    if device is None:
        # Auto: only if CUDA is already in use; resetting stats would otherwise create a context.
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return None
        return torch.device("cuda", torch.cuda.current_device())
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    if not torch.cuda.is_available():
        raise ValueError(f"PeakMemorySampler device={device!r} but torch sees no GPU; use device='cpu'")
    return torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())


def _nvml_peak(samples: list[GpuSample]) -> tuple[float | None, Literal["process", "device"] | None]:
    process = [s.process_used_mb for s in samples if s.process_used_mb is not None]
    if process:
        return max(process), "process"
    device = [s.device_used_mb for s in samples if s.device_used_mb is not None]
    if device:
        return max(device), "device"
    return None, None


def _mean(values: Any) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def combine_reports(reports: list[MemoryReport]) -> MemoryReport:
    """One report over several sampled blocks of the same process (the warm-up and the rounds of
    an interleaved run): peaks are the highest, rates the time-weighted means, the baseline the
    first block's."""
    if not reports:
        raise ValueError("combine_reports needs at least one report")
    seconds = sum(r.seconds for r in reports)

    def weighted(values: list[tuple[float | None, float]]) -> float | None:
        known = [(v, s) for v, s in values if v is not None]
        total = sum(s for _, s in known)
        return sum(v * s for v, s in known) / total if known and total > 0 else _mean(v for v, _ in known)

    def peak(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return max(known) if known else None

    return MemoryReport(
        peak_rss_mb=max(r.peak_rss_mb for r in reports),
        baseline_rss_mb=reports[0].baseline_rss_mb,
        cpu_util_percent=weighted([(r.cpu_util_percent, r.seconds) for r in reports]) or 0.0,
        cpu_util_fraction=weighted([(r.cpu_util_fraction, r.seconds) for r in reports]) or 0.0,
        gpu_peak_allocated_mb=peak([r.gpu_peak_allocated_mb for r in reports]),
        gpu_peak_reserved_mb=peak([r.gpu_peak_reserved_mb for r in reports]),
        nvml_used_mb=peak([r.nvml_used_mb for r in reports]),
        nvml_scope=next((r.nvml_scope for r in reports if r.nvml_scope), None),
        gpu_util_percent=weighted([(r.gpu_util_percent, r.seconds) for r in reports]),
        power_w=weighted([(r.power_w, r.seconds) for r in reports]),
        samples=sum(r.samples for r in reports),
        seconds=seconds,
    )
