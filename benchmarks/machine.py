"""The CPU a benchmark ran on, named at the top of every result file it writes.

The machines this project measures on differ by CPU (AVX2-only EPYCs, AVX512-BF16 EPYCs, AMX
Xeons), and a figure from one is not comparable with another's. So each result names its CPU:
/proc/cpuinfo's model, the cores, which of the flags accelab's fast paths choose by the CPU has,
and the level those paths took (`accelab.cpu.described`: with ACCELAB_CPU_ISA's cap when set).

    CPU: AMD EPYC (family 25 model 1), 2 cores; flags avx2 fma (no avx512f, ...); accelab level avx2

    lines = [cpu_line(), ...]                  # the first line of a .txt / .md result
    payload = {"cpu": cpu_record(), ...}       # the same facts in its JSON
    python benchmarks/machine.py               # the line alone, for the shell scripts
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from accelab import cpu

# AVX2 / FMA (every path), AVX-512 and VNNI (int8), native bf16 and fp16, AMX
FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor ends here; the others repeat it
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def _number(value: str | None) -> int | None:
    return int(value) if value and value.isdigit() else None


def cpu_record() -> dict[str, Any]:
    """The CPU as JSON: model, family, model_number, cores, flags ({flag: present}), level."""
    info = _cpuinfo()
    # the CPU's own flags, not the ones ACCELAB_CPU_ISA leaves: `level` says when a cap is set
    have = cpu.host_flags()
    return {
        "model": info.get("model name", "unknown"),
        "family": _number(info.get("cpu family")),
        "model_number": _number(info.get("model")),
        "cores": os.cpu_count(),
        "flags": {flag: flag in have for flag in FLAGS},
        "level": cpu.described(),
    }


def cpu_line() -> str:
    """`cpu_record` as one line, the first of a text result."""
    record = cpu_record()
    present = " ".join(flag for flag, on in record["flags"].items() if on) or "none"
    absent = ", ".join(flag for flag, on in record["flags"].items() if not on)
    return (
        f"CPU: {record['model']} (family {record['family']} model {record['model_number']}), "
        f"{record['cores']} cores; flags {present}{f' (no {absent})' if absent else ''}; "
        f"accelab level {record['level']}"
    )


if __name__ == "__main__":
    print(cpu_line())
