"""A small NVML wrapper: GPU inventory and telemetry samples, `None` wherever NVML or a GPU is
absent, so that callers never branch on "is there a GPU" to stay alive on a CPU machine.

NVML numbers GPUs by PCI order; CUDA (and `CUDA_VISIBLE_DEVICES`) may number them otherwise,
so a torch device index is mapped to its NVML handle through the PCI bus id.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuSample:
    """One NVML reading of one GPU. Every field is None when it could not be read."""

    process_used_mb: float | None  # this process's memory on the GPU (None if NVML hides pids)
    device_used_mb: float | None  # all processes together
    util_percent: float | None  # % of the last sample period a kernel was running
    power_w: float | None


EMPTY_SAMPLE = GpuSample(process_used_mb=None, device_used_mb=None, util_percent=None, power_w=None)


def _pynvml() -> Any | None:
    """The initialised `pynvml` module, or None when the package or the driver is missing."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()  # reference-counted by NVML: every init is paired with a shutdown
    except Exception as err:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ... (no common base)
        log.debug("NVML unavailable: %s", err)
        return None
    return pynvml


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _torch_cuda_ready() -> bool:
    """True when torch has a usable CUDA device. Never initialises CUDA on a CPU build."""
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _pci_bus_id(torch_index: int) -> str | None:
    import torch

    props = torch.cuda.get_device_properties(torch_index)
    # torch's stub does not list the PCI fields, and older builds lack them
    domain, bus, device = (getattr(props, f"pci_{name}_id", None) for name in ("domain", "bus", "device"))
    if domain is None or bus is None or device is None:
        return None
    return f"{domain:08x}:{bus:02x}:{device:02x}.0"


def _handle_for(nvml: Any, torch_index: int) -> Any:
    """NVML handle of torch's cuda:`torch_index`; by PCI bus id, else by the same index."""
    if _torch_cuda_ready():
        bus_id = _pci_bus_id(torch_index)
        if bus_id is not None:
            try:
                return nvml.nvmlDeviceGetHandleByPciBusId(bus_id)
            except Exception as err:  # noqa: BLE001 - any NVML error: fall back to the index
                log.debug("NVML has no GPU at PCI %s (%s); using index %d", bus_id, err, torch_index)
    return nvml.nvmlDeviceGetHandleByIndex(torch_index)


def _call(fn: Any, *args: Any) -> Any | None:
    """One NVML query; None when this GPU or driver does not support it."""
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001 - a telemetry read that fails is a missing figure, not an error
        log.debug("NVML %s failed: %s", getattr(fn, "__name__", fn), err)
        return None


class NvmlGpu:
    """Telemetry of one GPU (torch's cuda index). Every method is safe without NVML or a GPU:
    `available` is then False and `sample()` returns all-None values. Call `close()` when done
    (or use it as a context manager)."""

    def __init__(self, torch_index: int = 0) -> None:
        self._nvml = _pynvml()
        self._handle = None
        if self._nvml is not None:
            try:
                self._handle = _handle_for(self._nvml, torch_index)
            except Exception as err:  # noqa: BLE001 - any NVML error: no telemetry for this GPU
                log.debug("NVML has no GPU %d: %s", torch_index, err)
                self.close()

    @property
    def available(self) -> bool:
        return self._handle is not None

    def sample(self) -> GpuSample:
        nvml, handle = self._nvml, self._handle
        if nvml is None or handle is None:  # a handle comes with NVML; close() drops both
            return EMPTY_SAMPLE
        memory = _call(nvml.nvmlDeviceGetMemoryInfo, handle)
        util = _call(nvml.nvmlDeviceGetUtilizationRates, handle)
        power_mw = _call(nvml.nvmlDeviceGetPowerUsage, handle)
        return GpuSample(
            process_used_mb=self._process_used_mb(),
            device_used_mb=memory.used / 2**20 if memory is not None else None,
            util_percent=float(util.gpu) if util is not None else None,
            power_w=power_mw / 1000 if power_mw is not None else None,
        )

    def _process_used_mb(self) -> float | None:
        # In a container NVML may report host pids or none at all: then this is None, not 0.
        nvml = self._nvml
        procs = (_call(nvml.nvmlDeviceGetComputeRunningProcesses, self._handle) if nvml is not None else None) or []
        used = [p.usedGpuMemory for p in procs if p.pid == os.getpid() and p.usedGpuMemory is not None]
        return sum(used) / 2**20 if used else None

    def close(self) -> None:
        if self._nvml is not None:
            _call(self._nvml.nvmlShutdown)
            self._nvml = None
            self._handle = None

    def __enter__(self) -> NvmlGpu:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def gpu_inventory() -> list[dict[str, Any]]:
    """The GPUs of this machine: name, memory, driver, compute capability. [] without a GPU.

    Listed in NVML (PCI) order, which may differ from CUDA's order. The compute capability is
    NVML's own reading of each GPU; torch's is used only when NVML is missing."""
    nvml = _pynvml()
    if nvml is None:
        return _torch_only_inventory()
    try:
        driver = _text(_call(nvml.nvmlSystemGetDriverVersion) or "") or None
        count = _call(nvml.nvmlDeviceGetCount) or 0
        gpus = []
        for index in range(count):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = _call(nvml.nvmlDeviceGetMemoryInfo, handle)
            gpus.append(
                {
                    "index": index,
                    "name": _text(_call(nvml.nvmlDeviceGetName, handle) or "unknown"),
                    "memory_total_mb": memory.total / 2**20 if memory is not None else None,
                    "driver_version": driver,
                    "compute_capability": _nvml_capability(nvml, handle),
                }
            )
        return gpus
    finally:
        _call(nvml.nvmlShutdown)


def _nvml_capability(nvml: Any, handle: Any) -> str | None:
    cap = _call(nvml.nvmlDeviceGetCudaComputeCapability, handle)
    if cap is not None:
        return f"{cap[0]}.{cap[1]}"
    return None


def _torch_only_inventory() -> list[dict[str, Any]]:
    """GPUs as torch sees them when NVML is missing (e.g. a container without the library)."""
    if not _torch_cuda_ready():
        return []
    import torch

    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append(
            {
                "index": index,
                "name": props.name,
                "memory_total_mb": props.total_memory / 2**20,
                "driver_version": None,
                "compute_capability": f"{props.major}.{props.minor}",
            }
        )
    return gpus
