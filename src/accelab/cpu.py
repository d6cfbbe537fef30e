"""The CPU's instruction sets as accelab's own paths see them, and the override that makes a bigger
CPU take a smaller one's paths.

The machines this project runs on change CPU from one run to the next (AVX2-only EPYCs,
AVX512-BF16 EPYCs, AMX Xeons), and every fast path has a path for the others. To test on one
machine what another runs, `ACCELAB_CPU_ISA` names the highest level to use:

    avx2          AVX2 + FMA: no AVX-512, no VNNI, no native bf16, no AMX
    avx512        AVX-512 (F, BW, VL, VNNI): no native bf16, no AMX
    avx512_bf16   AVX-512 with BF16: no AMX
    amx           everything the CPU has (the same as leaving it unset)

It caps three things alike: accelab's own reading of the CPU's flags (`flags`: the serving
kernels' choice and build, `accelab env`'s capability report), oneDNN's (`ONEDNN_MAX_CPU_ISA`)
and torch's own kernels (`ATEN_CPU_CAPABILITY`). The last two are read by torch when it starts,
so `apply_override` runs when accelab is imported, before torch is; a child process inherits them.
What changes is which kernels run, not the machine's speed: an AMX CPU capped at avx2 runs the
AVX2 kernels at its own speed.

No torch here: this module is read before torch is imported.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Literal, get_args

ENV = "ACCELAB_CPU_ISA"
Level = Literal["avx2", "avx512", "avx512_bf16", "amx"]
LEVELS: tuple[Level, ...] = get_args(Level)

# each level: oneDNN's name for it, torch's, the flags' prefixes above it, and the compiler's target
_ONEDNN: dict[Level, str] = {
    "avx2": "AVX2",
    "avx512": "AVX512_CORE_VNNI",
    "avx512_bf16": "AVX512_CORE_BF16",
    "amx": "AVX512_CORE_AMX",
}
_ATEN: dict[Level, str] = {"avx2": "avx2", "avx512": "avx512", "avx512_bf16": "avx512", "amx": "avx512"}
_ABOVE: dict[Level, tuple[str, ...]] = {
    "avx2": ("avx512", "amx", "avx_vnni", "avx10"),
    "avx512": ("avx512_bf16", "avx512_fp16", "amx", "avx10"),
    "avx512_bf16": ("avx512_fp16", "amx", "avx10"),
    "amx": (),
}
# what g++ builds the own kernels for at each level (-march=native: for everything this CPU has)
MARCH: dict[Level, list[str]] = {
    "avx2": ["-march=x86-64-v3"],
    "avx512": ["-march=x86-64-v4", "-mavx512vnni"],
    "avx512_bf16": ["-march=native", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8", "-mno-avx512fp16"],
    "amx": ["-march=native"],
}


def level() -> Level | None:
    """The level ACCELAB_CPU_ISA names, or None when it is unset (the CPU's own)."""
    value = os.environ.get(ENV, "").strip().lower()
    if not value:
        return None
    if value not in LEVELS:
        raise ValueError(f"{ENV}={value!r} is not a CPU level; use one of {', '.join(LEVELS)} (or leave it unset)")
    return value  # checked against LEVELS just above


def apply_override() -> None:
    """Cap oneDNN and torch at the level ACCELAB_CPU_ISA names (a setting the user made of either
    stays as it is). Before torch is imported: both read them when they start."""
    chosen = level()
    if chosen is not None and chosen != "amx":
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", _ONEDNN[chosen])
        os.environ.setdefault("ATEN_CPU_CAPABILITY", _ATEN[chosen])


def host_flags() -> frozenset[str]:
    """The CPU's own feature flags (/proc/cpuinfo's first `flags` line; empty where there is none)."""
    return _host_flags()


@functools.cache
def _host_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def flags() -> frozenset[str]:
    """The CPU's feature flags as accelab uses them: the host's, less those above ACCELAB_CPU_ISA."""
    chosen = level()
    host = host_flags()
    if chosen is None:
        return host
    return frozenset(flag for flag in host if not flag.startswith(_ABOVE[chosen]))


def has(*names: str) -> bool:
    """All of `names` are among `flags()`."""
    have = flags()
    return all(name in have for name in names)


def native_bf16() -> bool:
    """bf16 matmuls run natively (AVX512-BF16 or AMX) on the CPU as accelab uses it."""
    return has("avx512_bf16") or has("amx_bf16")


def native_fp16() -> bool:
    """fp16 matmuls run natively (AVX512-FP16 or AMX-FP16)."""
    return has("avx512_fp16") or has("amx_fp16")


def current() -> Level:
    """The highest level the CPU, as accelab uses it, reaches (below avx2 counts as avx2)."""
    if has("amx_tile", "amx_bf16"):
        return "amx"
    if native_bf16():
        return "avx512_bf16"
    if has("avx512f"):
        return "avx512"
    return "avx2"


def described() -> str:
    """One line for logs and result files: the level, and the override when one is set."""
    chosen = level()
    own = current()
    return own if chosen is None else f"{own} (capped by {ENV}={chosen})"


def march() -> list[str]:
    """g++'s target flags for the own kernels: the CPU's own, or the level the override names."""
    chosen = level()
    return MARCH[chosen] if chosen is not None else MARCH["amx"]
