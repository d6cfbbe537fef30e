"""Building and loading the own C++ operators (`decode_attention`, `int8_gemm`): once per machine.

Each is a small library of `accelab::` operators, a C++ file in `csrc/` compiled by torch's C++
extension loader (g++, which a compiled plan needs anyway; -march=native, so it is built where it
runs, or for the level ACCELAB_CPU_ISA names: `accelab.cpu`): `make install` builds them all
(`python -m accelab.ops.build`), else the first process that needs one does (~20 s each). Later
processes load the library from ACCELAB_KERNELS (~/.cache/accelab/kernels), keyed by its source,
the flags, torch's version and the CPU's feature flags (a build under torch's own extension cache
is keyed by the venv's path and pulls in setuptools and sympy, ~85 MB, only to find it). A build
happens in a private directory and is moved into place in one rename: another process never
loads a half-written library.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from accelab import cpu

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"  # the libraries' C++ sources, shipped with the package
# what `make test` compiles them with besides (tests/test_kernels_source.py): a warning fails the
# suite, never a user's build
WARNINGS = ["-Wall", "-Wextra", "-Werror"]


def flags() -> list[str]:
    """g++'s flags: optimised, for this CPU (or the level ACCELAB_CPU_ISA names), with OpenMP."""
    return ["-O3", *cpu.march(), "-fopenmp", "-fno-math-errno"]


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as the kernels see them (`accelab.cpu.flags`: the override applied)."""
    return cpu.flags()


def library_path(name: str, source: str) -> Path:
    """Where this machine's build of library `name` lives (one per source, flags, torch and CPU)."""
    parts = [source, *flags(), torch.__version__, " ".join(sorted(cpu.host_flags()))]
    key = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    root = Path(os.environ.get("ACCELAB_KERNELS") or Path.home() / ".cache" / "accelab" / "kernels")
    return root / f"{name}-{key}" / f"{name}.so"


def build(name: str, file: str) -> Path:
    """Compile library `name` from `csrc/<file>` for this machine and load it (g++, ~20 s)."""
    from torch.utils.cpp_extension import load as load_extension

    path = library_path(name, (CSRC / file).read_text())
    scratch = path.parent.with_name(f"{path.parent.name}.build-{os.getpid()}")
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        load_extension(
            name=name,
            sources=[str(CSRC / file)],
            extra_cflags=flags(),
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


def load(name: str, file: str, op: str) -> str | None:
    """Load library `name` (building it from `csrc/<file>` first where this machine has none) unless
    `accelab::op` is already there: None, or why it is not."""
    if hasattr(torch.ops.accelab, op):
        return None
    try:
        path = library_path(name, (CSRC / file).read_text())
        if path.exists():
            torch.ops.load_library(str(path))
        else:
            log.info("building %s for this machine (once, ~20 s)", name)
            build(name, file)
    except Exception as err:  # noqa: BLE001 - no compiler, a failed build: the caller keeps its tensor ops
        why = f"{type(err).__name__}: {err}"
        log.warning("%s did not build (%s); the engines use tensor operations instead", name, why)
        return f"it did not build: {why}"
    return None


@dataclass(eq=False)
class Library:
    """One library of `accelab::` operators: its C++ file in `csrc/`, the operator that says it is
    loaded, the CPU flags it needs (declared here once: the file compiles its fast path only where
    the target has them), and the shape function compiled graphs trace it with
    (`torch.library.register_fake`)."""

    name: str
    file: str
    op: str
    fake: Callable[..., torch.Tensor]
    needs: tuple[str, ...] = ()
    needs_said: str = ""  # the needs in words, for the reason a CPU without them is given

    def path(self) -> Path:
        """Where this machine's build lives."""
        return library_path(self.name, self.source)

    @property
    def source(self) -> str:
        return (CSRC / self.file).read_text()

    def build(self) -> Path:
        """Compile the library for this machine (~20 s)."""
        return build(self.name, self.file)

    @functools.cache  # noqa: B019 - the libraries are module constants: kept for the process anyway
    def ready(self) -> str | None:
        """Load the library once per process (building it first where this machine has none): None,
        or why its operators are not there."""
        missing = [flag for flag in self.needs if flag not in cpu_flags()]
        if missing:
            return f"it needs a CPU with {self.needs_said} (this one lacks {', '.join(missing)})"
        why = load(self.name, self.file, self.op)
        if why is None:
            torch.library.register_fake(f"accelab::{self.op}")(self.fake)
        return why
