"""The serving engines' own C++ operators (`decode_attention`, `int8_gemm`): built once per machine.

Each is a small library of `accelab::` operators compiled by torch's C++ extension loader (g++,
which a compiled plan needs anyway; -march=native, so it is built where it runs): `make install`
builds them all (`python -m accelab.serve.engines.build_kernels`), else the first process that needs
one does (~20 s each). Later processes load the library from ACCELAB_KERNELS
(~/.cache/accelab/kernels), keyed by its source, the flags, torch's version and the CPU's feature
flags (a build under torch's own extension cache is keyed by the venv's path and pulls in
setuptools and sympy, ~85 MB, only to find it). A build happens in a private directory and is
moved into place in one rename: another process never loads a half-written library.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo's first `flags` line; empty where there is none)."""
    line = next((line for line in _cpuinfo().splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def library_path(name: str, source: str) -> Path:
    """Where this machine's build of library `name` lives."""
    cpu = next((line for line in _cpuinfo().splitlines() if line.startswith("flags")), platform.machine())
    key = hashlib.sha256("\n".join([source, *FLAGS, torch.__version__, cpu]).encode()).hexdigest()[:16]
    root = Path(os.environ.get("ACCELAB_KERNELS") or Path.home() / ".cache" / "accelab" / "kernels")
    return root / f"{name}-{key}" / f"{name}.so"


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def build(name: str, source: str) -> Path:
    """Compile library `name` for this machine and load it (g++, ~20 s)."""
    from torch.utils.cpp_extension import load_inline

    path = library_path(name, source)
    scratch = path.parent.with_name(f"{path.parent.name}.build-{os.getpid()}")
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        load_inline(
            name=name,
            cpp_sources=source,
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(scratch),
            is_python_module=False,
            verbose=False,
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(scratch / f"{name}.so", path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return path


def load(name: str, source: str, op: str) -> str | None:
    """Load library `name` (building it first where this machine has none) unless `accelab::op` is
    already there: None, or why it is not."""
    if hasattr(torch.ops.accelab, op):
        return None
    try:
        path = library_path(name, source)
        if path.exists():
            torch.ops.load_library(str(path))
        else:
            log.info("building %s for this machine (once, ~20 s)", name)
            build(name, source)
    except Exception as err:  # noqa: BLE001 - no compiler, a failed build: the caller keeps its tensor ops
        why = f"{type(err).__name__}: {err}"
        log.warning("%s did not build (%s); the engines use tensor operations instead", name, why)
        return f"it did not build: {why}"
    return None


@dataclass(eq=False)
class Library:
    """One library of `accelab::` operators: its source, the operator that says it is loaded, the CPU
    flags it needs, and the shape function compiled graphs trace it with (`torch.library.register_fake`)."""

    name: str
    source: str
    op: str
    fake: Callable[..., torch.Tensor]
    needs: tuple[str, ...] = ()
    needs_said: str = ""  # the needs in words, for the reason a CPU without them is given

    def path(self) -> Path:
        """Where this machine's build lives."""
        return library_path(self.name, self.source)

    def build(self) -> Path:
        """Compile the library for this machine (~20 s)."""
        return build(self.name, self.source)

    @functools.cache  # noqa: B019 - the libraries are module constants: kept for the process anyway
    def ready(self) -> str | None:
        """Load the library once per process (building it first where this machine has none): None,
        or why its operators are not there."""
        missing = [flag for flag in self.needs if flag not in cpu_flags()]
        if missing:
            return f"it needs a CPU with {self.needs_said} (this one lacks {', '.join(missing)})"
        why = load(self.name, self.source, self.op)
        if why is None:
            torch.library.register_fake(f"accelab::{self.op}")(self.fake)
        return why
