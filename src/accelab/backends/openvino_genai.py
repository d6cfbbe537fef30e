"""OpenVINO GenAI as accelab's text-generation runtime: `backend: openvino` on a text-generation
model runs OpenVINO GenAI's ContinuousBatchingPipeline (its paged attention, scheduler and prefix
cache) in accelab's OpenVINO engine process (`openvino_engine.py`), in a venv of its own.

Why a venv of its own: optimum-intel (the exporter) resolves transformers 5.5 and accelab runs
5.2x, and PyPI's torchvision beside the CPU torch breaks the exporter. `make openvino` builds
`.venv-openvino` (torch 2.13 CPU, openvino-genai, optimum-intel); found in this order:
`ACCELAB_OPENVINO_VENV`, `.venv-openvino` beside the checkout (or the current directory), this
interpreter when both packages are installed here.

The model is exported once per model and weight format (`ov_weights` fp32 | int8 | int4, NNCF's
weight compression through optimum-intel's exporter) into accelab's cache, with a progress line;
a changed weight file exports again. Everything after that is the engine-process path vLLM uses:
the same wire, client, measuring model (`engine_model`) and serving worker, so bench, compare,
verify, tune and serve take OpenVINO plans like any other.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from accelab.backends import engine_launch, engine_wire as W
from accelab.backends.engine_client import EngineClient
from accelab.backends.engine_launch import keep_seconds, model_stamp
from accelab.backends.engine_model import check_checkpoint, engine_runnable
from accelab.backends.export import build_atomically
from accelab.catalog.spec import ModelSpec
from accelab.paths import cache_dir
from accelab.plan.backend_options import OvOptions
from accelab.plan.plan import Plan
from accelab.plan.runtime import Runnable, Unsupported
from accelab.version import __version__

log = logging.getLogger(__name__)

VENV_ENV = "ACCELAB_OPENVINO_VENV"
KEEP_ENV = "ACCELAB_OPENVINO_KEEP_S"
START_TIMEOUT_S = 300.0  # the pipeline compiles in 2-10 s here
EXPORT_TIMEOUT_S = 1800.0
ENGINE_SCRIPT = Path(__file__).with_name("openvino_engine.py")
# the files the engine process runs (it loads its siblings by path): its code in the engine's key
ENGINE_CODE = [ENGINE_SCRIPT, *(ENGINE_SCRIPT.with_name(name) for name in ("engine_wire.py", "openvino_scorer.py"))]
EXPORT_FORMAT = 1  # bump when the export command changes
INSTALL_HINT = (
    "run `make openvino` in the accelab checkout (it builds .venv-openvino with openvino-genai and "
    "optimum-intel), or set ACCELAB_OPENVINO_VENV to a venv where both are installed"
)
# optimum-intel's --weight-format and what else each format needs
_EXPORT_ARGS = {
    "fp32": ["--weight-format", "fp32"],
    "int8": ["--weight-format", "int8"],
    # asymmetric int4 in groups of 64 for every layer NNCF compresses (SmolLM2's 576 is no multiple
    # of 128, optimum-intel's default group)
    "int4": ["--weight-format", "int4", "--group-size", "64", "--ratio", "1.0"],
}


@dataclass(frozen=True, kw_only=True, slots=True)
class GenAIInstall:
    python: Path
    venv: Path
    version: str  # openvino-genai's
    exporter: str  # optimum-intel's

    def describe(self) -> str:
        return f"openvino-genai {self.version} (optimum-intel {self.exporter}) in {self.venv}"

    @property
    def optimum_cli(self) -> Path:
        return self.python.parent / "optimum-cli"


# -- finding it ------------------------------------------------------------------------------------
def _candidates() -> Iterator[tuple[Path, str]]:
    override = os.environ.get(VENV_ENV)
    if override:
        yield Path(override).expanduser(), f"{VENV_ENV}={override}"
        return
    checkout = Path(__file__).resolve().parents[3]
    for root in dict.fromkeys([checkout, Path.cwd()]):
        yield root / ".venv-openvino", "the checkout's .venv-openvino"
    yield Path(sys.prefix), "this Python"


def _version(venv: Path, distribution: str) -> str | None:
    for info in sorted(venv.glob(f"lib/python3*/site-packages/{distribution}-*.dist-info")):
        return info.name.removesuffix(".dist-info").split("-", 1)[1]
    return None


def find_genai() -> tuple[GenAIInstall | None, str]:
    """The OpenVINO GenAI install accelab would use, or None with the reason (and how to fix it)."""
    looked = []
    for venv, where in _candidates():
        python = venv / "bin" / "python"
        version, exporter = _version(venv, "openvino_genai"), _version(venv, "optimum_intel")
        if version and exporter and python.exists():
            return GenAIInstall(python=python, venv=venv, version=version, exporter=exporter), where
        looked.append(str(venv))
    return None, f"OpenVINO GenAI is not installed (looked in {', '.join(looked)}): {INSTALL_HINT}"


# -- checks (nothing imported, nothing started) ----------------------------------------------------
def check_model(spec: ModelSpec, device: torch.device) -> None:
    """Unsupported unless OpenVINO GenAI can run `spec` here: a checkpoint in the Hugging Face
    layout the exporter reads, on the CPU."""
    check_checkpoint(spec, backend="openvino", verb="exports for generation")
    if device.type != "cpu":
        raise Unsupported(f"accelab runs OpenVINO GenAI on its CPU plugin; this run is on {device}: use --device cpu")


def check_install() -> None:
    install, reason = find_genai()
    if install is None:
        raise Unsupported(reason)


def check_bf16(options: OvOptions) -> None:
    """ov_precision=bf16 (or a bf16 KV cache) only where the CPU has native bf16, as for forward graphs."""
    if "bf16" not in (options.precision, options.kv_cache_precision) or importlib.util.find_spec("openvino") is None:
        return
    import openvino as ov

    from accelab.backends.openvino import check_precision

    check_precision(replace(options, precision="bf16"), ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"))


# -- the export, cached ----------------------------------------------------------------------------
def export_dir(spec: ModelSpec, weights: str, install: GenAIInstall) -> Path:
    blob = json.dumps(
        [model_stamp(str(Path(spec.source).resolve())), weights, install.version, install.exporter, EXPORT_FORMAT],
        sort_keys=True,
    )
    key = hashlib.sha256(blob.encode()).hexdigest()[:12]
    return cache_dir() / "openvino-genai" / f"{spec.name.replace('/', '--')}-{weights}-{key}"


def exported(spec: ModelSpec, weights: str, install: GenAIInstall) -> Path:
    """The model's OpenVINO export with `weights`, from the cache, exporting it first when new."""
    directory = export_dir(spec, weights, install)
    if (directory / "openvino_model.xml").is_file():
        log.info("reusing the OpenVINO export of %s (%s weights) from %s", spec.name, weights, directory)
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    with engine_launch.locked(directory.with_suffix(".lock")):  # one export per key, however many ask
        if not (directory / "openvino_model.xml").is_file():
            print(
                f"accelab: exporting {spec.name} to OpenVINO with {weights} weights, once per model and weight "
                f"format (about a minute for 135M parameters) into {directory}",
                file=sys.stderr,
                flush=True,
            )
            started = time.perf_counter()
            build_atomically(directory, lambda tmp: _export(spec, weights, install, tmp))
            print(f"accelab: exported in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return directory


def _export(spec: ModelSpec, weights: str, install: GenAIInstall, out: Path) -> None:
    command = [
        str(install.optimum_cli),
        "export",
        "openvino",
        "--model",
        str(Path(spec.source).resolve()),
        "--task",
        "text-generation-with-past",
        *_EXPORT_ARGS[weights],
        str(out),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    log.info("exporting: %s", " ".join(command))
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=EXPORT_TIMEOUT_S, check=False)
    if done.returncode != 0 or not (out / "openvino_model.xml").is_file():
        tail = "\n".join(line for line in (done.stdout + done.stderr).splitlines()[-15:])
        raise Unsupported(
            f"optimum-intel could not export {spec.name} to OpenVINO ({weights} weights; exit "
            f"{done.returncode}):\n{tail}"
        )


# -- the engine ------------------------------------------------------------------------------------
def engine_config(
    export: Path, options: OvOptions, *, keep_s: float, threads: int | None, max_num_seqs: int | None = None
) -> W.OvEngineConfig:
    return W.OvEngineConfig(
        model=str(export),
        precision=options.precision,
        kv_precision=options.kv_cache_precision,
        max_num_seqs=options.max_num_seqs or max_num_seqs,
        max_num_batched_tokens=options.max_num_batched_tokens,
        kv_cache_bytes=options.kv_cache_gib * 2**30,
        prefix_caching=options.prefix_caching == "on",
        threads=threads,
        keep_s=keep_s,
    )


def engine_key(config: W.OvEngineConfig, install: GenAIInstall, *, owner: int | None = None) -> str:
    """Same export, engine config, install and engine code -> the same engine; `owner`: the pid of
    the one process an engine kept 0 s belongs to (serve's)."""
    code = hashlib.sha256(b"".join(path.read_bytes() for path in ENGINE_CODE))
    blob = json.dumps(
        [
            asdict(replace(config, keep_s=0.0)),
            str(install.python),
            install.version,
            __version__,
            code.hexdigest(),
            owner,
        ],
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def connect(
    spec: ModelSpec,
    plan: Plan,
    install: GenAIInstall,
    options: OvOptions,
    *,
    keep_s: float,
    max_num_seqs: int | None = None,
) -> EngineClient:
    """A client of the engine for this plan (started now, or the one already running)."""
    check_bf16(options)
    export = exported(spec, options.weights, install)
    config = engine_config(export, options, keep_s=keep_s, threads=plan.threads, max_num_seqs=max_num_seqs)
    key = engine_key(config, install, owner=os.getpid() if keep_s == 0 else None)
    env = {**os.environ, "PATH": f"{install.python.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    sock, address = engine_launch.connect_or_start(
        kind="openvino",
        key=key,
        command=[str(install.python), "-P", str(ENGINE_SCRIPT), "--config", config.to_json()],
        env=env,
        name="OpenVINO GenAI engine",
        timeout_s=START_TIMEOUT_S,
    )
    return EngineClient(sock, name=f"OpenVINO GenAI engine {address.key}")


def load(
    spec: ModelSpec,
    plan: Plan,
    device: torch.device,
    *,
    keep_s: float | None = None,
    max_num_seqs: int | None = None,
) -> Runnable:
    """The Runnable on the OpenVINO GenAI engine; `keep_s`: how long the engine outlives its last
    client (None: ACCELAB_OPENVINO_KEEP_S, default 600 s, so the next measurement reuses it);
    `max_num_seqs`: where the plan leaves it (serve's --max-batch-size; else OpenVINO's 256)."""
    started = time.perf_counter()
    install, reason = find_genai()
    if install is None:
        raise Unsupported(reason)
    options = OvOptions.parse(plan.option)
    keep = keep_seconds(KEEP_ENV) if keep_s is None else keep_s
    client = connect(spec, plan, install, options, keep_s=keep, max_num_seqs=max_num_seqs)
    info = client.info
    export = Path(info.model)
    notes = [
        f"OpenVINO GenAI {info.version} ContinuousBatchingPipeline ({install.describe()}), "
        f"engine pid {info.pid}: {options.weights} weights, inference {options.precision}, KV cache "
        f"{options.kv_cache_precision} in {info.kv_blocks} blocks of {info.block_size}, max_num_seqs "
        f"{info.max_num_seqs}, {info.max_num_batched_tokens} tokens per step, prefix caching "
        f"{'on' if info.prefix_caching else 'off'}",
        f"export {export}; engine ready in {info.load_s:.0f} s when it started; this run connected after "
        f"{time.perf_counter() - started:.1f} s (an engine is reused across runs of the same plan)",
    ]
    weight_bytes = sum(p.stat().st_size for p in export.glob("openvino_model.bin")) or None
    return engine_runnable(client, spec, plan, device, notes=notes, weight_bytes=weight_bytes)
