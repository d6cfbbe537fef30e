"""What machine and software a result was measured on. Fast: reads files and versions, runs no
micro-benchmark (those live in `hardware.py`).

`fingerprint()` hashes the parts that decide whether two results are comparable, so that a
result measured on another CPU, GPU, driver or torch is never compared with this one as equal.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import socket
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil

from accelab import cpu
from accelab.measure.gpu import gpu_inventory

# Distribution names to look up; several names for one package where it ships under more than one.
PACKAGES: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "transformers": ("transformers",),
    "accelerate": ("accelerate",),
    "torchao": ("torchao",),
    "onnxruntime": ("onnxruntime", "onnxruntime-gpu", "onnxruntime-openvino"),
    "openvino": ("openvino",),
    "llama_cpp": ("llama-cpp-python", "llama_cpp_python"),
    "triton": ("triton", "pytorch-triton"),
    "flash_attn": ("flash-attn", "flash_attn"),
}

# /proc/cpuinfo flags that decide which kernels a CPU can run.
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")

# The parts of environment() that make two measurements comparable.
FINGERPRINT_KEYS = ("cpu_model", "physical_cores", "logical_cores", "gpus", "driver_version", "versions")
FINGERPRINT_VERSIONS = ("torch", "transformers", "accelerate")


def environment() -> dict[str, Any]:
    """A JSON-serialisable description of this machine and its software."""
    gpus = gpu_inventory()
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "physical_cores": psutil.cpu_count(logical=False),
        "logical_cores": psutil.cpu_count(logical=True),
        "available_cores": available_cores(),
        "cpu": cpu_capability(),
        "cpu_isa": cpu.level(),  # ACCELAB_CPU_ISA, when set: the paths of a smaller CPU
        "ram_total_bytes": psutil.virtual_memory().total,
        "gpus": gpus,
        "driver_version": gpus[0]["driver_version"] if gpus else None,
        "cuda_version": _torch_attr("version.cuda"),
        "versions": {"python": platform.python_version(), **package_versions()},
        "torch_threads": _torch_threads(),
        "c_compiler": c_compiler(),
    }


def fingerprint(env: dict[str, Any]) -> str:
    """A 12-hex-digit hash of what makes results comparable: CPU model, core counts, GPU names,
    driver, and the torch/transformers/accelerate versions. Equal fingerprints: same machine
    class and software; the hostname is left out (two identical nodes compare as equal)."""
    versions = env.get("versions", {})
    key = {
        "cpu_model": env.get("cpu_model"),
        **({"cpu_isa": env["cpu_isa"]} if env.get("cpu_isa") else {}),  # ACCELAB_CPU_ISA: other kernels
        "physical_cores": env.get("physical_cores"),
        "logical_cores": env.get("logical_cores"),
        "gpus": sorted(g.get("name", "") for g in env.get("gpus", [])),
        "driver_version": env.get("driver_version"),
        "versions": {name: versions.get(name) for name in FINGERPRINT_VERSIONS},
    }
    blob = json.dumps(key, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def cpu_model() -> str:
    """The CPU's marketing name ("model name" in /proc/cpuinfo; platform's guess elsewhere)."""
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def available_cores() -> int:
    """Cores this process may run on (affinity / cgroup cpuset), not the machine's total."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def cpu_capability() -> dict[str, Any]:
    """Instruction sets: what /proc/cpuinfo lists, and what torch will dispatch to.

    The two can disagree (a hypervisor may list avx512_bf16 while torch's cpuinfo does not
    see it); torch's view decides which kernels run, so `native_bf16` follows torch. Under
    ACCELAB_CPU_ISA (`accelab.cpu`) the flags and torch's view are both capped at its level:
    `level` says which level the paths take, `host_flags` what the CPU itself has."""
    flags, host = cpu.flags(), cpu.host_flags()
    import torch

    def capped(probe: str, native: bool) -> bool | None:
        seen = _safe_call(getattr(torch.cpu, probe, None))
        return seen if seen is None or not host else bool(seen and native)

    torch_bf16 = capped("_is_avx512_bf16_supported", cpu.has("avx512_bf16"))
    torch_amx = capped("_is_amx_tile_supported", cpu.has("amx_tile"))
    torch_fp16 = capped("_is_amx_fp16_supported", cpu.has("amx_fp16"))
    return {
        "flags": {flag: flag in flags for flag in CPU_FLAGS} if host else {},
        "host_flags": {flag: flag in host for flag in CPU_FLAGS} if host else {},
        "level": cpu.described(),
        "torch_capability": _safe_call(getattr(torch.backends.cpu, "get_cpu_capability", None)),
        "torch_avx512_bf16": torch_bf16,
        "torch_amx_tile": torch_amx,
        "torch_amx_fp16": torch_fp16,
        "native_bf16": bool(torch_bf16 or torch_amx),
        "native_fp16": bool(torch_fp16),
    }


def package_versions() -> dict[str, str | None]:
    """Installed version of each package in PACKAGES; None when it is not installed."""
    return {name: _version(dists) for name, dists in PACKAGES.items()}


def c_compiler() -> str | None:
    """Path of the C compiler torch.compile's inductor would use on CPU, if any."""
    for name in (os.environ.get("CXX"), os.environ.get("CC"), "g++", "gcc", "clang++", "clang", "cc"):
        if name and (path := shutil.which(name)):
            return path
    return None


def _version(dists: tuple[str, ...]) -> str | None:
    for dist in dists:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _torch_threads() -> dict[str, int]:
    import torch

    return {"intra_op": torch.get_num_threads(), "inter_op": torch.get_num_interop_threads()}


def _torch_attr(dotted: str) -> Any:
    import torch

    value: Any = torch
    for part in dotted.split("."):
        value = getattr(value, part, None)
    return value


def _safe_call(fn: Any) -> Any:
    """fn() or None: private torch probes move between releases."""
    if fn is None:
        return None
    try:
        return fn()
    except Exception:  # noqa: BLE001 - a private probe may raise anything; its figure is then unknown
        return None


if __name__ == "__main__":  # python -m accelab.measure.environment
    json.dump(environment(), sys.stdout, indent=2)
