"""This machine's physical limits, measured: peak FLOP/s per compute path and memory bandwidth,
the two denominators of every roofline figure accelab reports. Cached in
`cache_dir()/hardware.json`, keyed by the environment fingerprint, the device and the thread
count, because they take a few seconds to measure and do not change between runs; `accelab
env` and bench read the same entry, so they print the same figures.

The kernels are the ones models run (`accelab.measure.kernels`): a peak is the best of Linear,
conv and matmul for its path, bandwidth the best of read, copy and triad. What each technique
can do here is `accelab.measure.capabilities`, which reads these limits and the probes
(`accelab.measure.probes`) cached with them.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from accelab.measure import kernels, noise, probes
from accelab.measure.environment import environment, fingerprint
from accelab.measure.kernels import cuda_tf32
from accelab.paths import cache_dir

log = logging.getLogger(__name__)

CACHE_FILE = "hardware.json"

# the compute path a plan's precision runs its matmuls in
PRECISION_PATHS = {
    "fp32": "fp32",
    "bf16-autocast": "bf16-autocast",
    "fp16-autocast": "fp16-autocast",
    "bf16-weights": "bf16",
    "fp16-weights": "fp16",
    "fp8": "bf16",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class HardwareLimits:
    """Measured limits of one device at one thread count.

    Each *_flops is the best FLOP/s of that compute path over the kernels models run (Linear,
    conv, matmul): fp32 on CUDA is strict IEEE (TF32 off); tf32, fp16 and the fp16 paths exist
    on CUDA only. bandwidth_bytes_per_s is the best of STREAM's read, copy and triad."""

    device: str
    fp32_flops: float
    bf16_flops: float | None
    tf32_flops: float | None
    bandwidth_bytes_per_s: float
    threads: int
    measured_at: str  # ISO 8601, UTC
    fingerprint: str
    bf16_autocast_flops: float | None = None
    fp16_flops: float | None = None
    fp16_autocast_flops: float | None = None
    kernels: dict[str, str] = field(default_factory=dict)  # figure -> the kernel that reached it
    probes: dict[str, float] = field(default_factory=dict)  # technique -> speed against fp32 eager
    probe_details: dict[str, dict[str, Any]] = field(default_factory=dict)  # technique -> probes.Probe.to_dict()
    noise: dict[str, Any] = field(default_factory=dict)  # the machine while the peaks were measured (noise.summary)

    @property
    def trusted(self) -> bool:
        """Measured quietly enough: the peaks' window was not unreliable and every probe is trusted."""
        return self.noise.get("level") != "unreliable" and all(
            d.get("trusted", True) for d in self.probe_details.values()
        )

    def peak_for(self, precision: str) -> tuple[str, float | None]:
        """(compute path, its peak FLOP/s) for a plan's precision; the peak is None where the
        path was not measured on this device."""
        path = PRECISION_PATHS.get(precision, "fp32")
        value = {
            "fp32": self.fp32_flops,
            "bf16": self.bf16_flops,
            "bf16-autocast": self.bf16_autocast_flops,
            "fp16": self.fp16_flops,
            "fp16-autocast": self.fp16_autocast_flops,
        }.get(path)
        return path, value


def _resolve_device(device: str | torch.device) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} asked for CUDA, but torch sees no GPU here; use device='cpu'")
        return torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
    if dev.type != "cpu":
        raise ValueError(f"device={device!r} is not supported: use 'cpu' or 'cuda[:N]'")
    return dev


# --- the cache ---------------------------------------------------------------------------


def hardware_limits(device: str | torch.device = "cpu", refresh: bool = False) -> HardwareLimits:
    """Peak fp32/bf16 (and TF32 on CUDA) matmul FLOP/s and read bandwidth of `device`, from
    the cache unless `refresh` or this machine/software/thread count has not been measured."""
    dev = _resolve_device(device)
    threads = torch.get_num_threads()
    fp = fingerprint(environment())
    if not refresh and (limits := cached_limits(dev, _fingerprint=fp)) is not None:
        if limits.trusted:
            return limits
        # measured under noise: measured again when the machine is quiet now, else kept as marked
        now = noise.sample_now(0.5)
        if now is not None and now.level != "quiet":
            log.info(
                "cached %s limits were measured under noise; the machine is %s now (%s): kept",
                dev,
                now.level,
                now.reason,
            )
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
    paths = kernels.PATHS_CUDA if dev.type == "cuda" else kernels.PATHS_CPU
    with noise.Meter() as meter:
        peaks = {path: kernels.peak_flops(path, dev) for path in paths}
        if dev.type == "cuda":
            with cuda_tf32(False):  # fp32 is strict IEEE; tf32 measured apart
                peaks["fp32"] = kernels.peak_flops("fp32", dev)
        band = kernels.bandwidth(dev)
    found = probes.probe_all(dev)

    def peak(path: str) -> float | None:  # None: a path this device does not have
        rate = peaks.get(path)
        return (rate.value or None) if rate is not None else None

    return HardwareLimits(
        device=str(dev),
        fp32_flops=peaks["fp32"].value,  # every device has the fp32 path
        bf16_flops=peak("bf16"),
        tf32_flops=peak("tf32"),
        fp16_flops=peak("fp16"),
        bf16_autocast_flops=peak("bf16-autocast"),
        fp16_autocast_flops=peak("fp16-autocast"),
        bandwidth_bytes_per_s=band.value,
        threads=threads,
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        fingerprint=fp,
        kernels={**{path: rate.kernel for path, rate in peaks.items()}, "bandwidth": band.kernel},
        probes={name: p.factor for name, p in found.items() if p.factor is not None},
        probe_details={name: p.to_dict() for name, p in found.items()},
        noise=noise.summary([meter.window]) if meter.window is not None else {},
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
