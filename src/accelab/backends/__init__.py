"""Alternative runtimes: ONNX Runtime, OpenVINO, llama.cpp and vLLM behind the same Runnable as torch.

Each backend is an entry of `BACKENDS` (a check, then a loader) that `accelab.runtimes`, the one
seam for loading a runnable, puts beside torch; `load_backend` runs one directly.
A runtime that is not installed, or cannot serve this model, task or device, raises
`Unsupported` with the reason (and the install command), so a compare row says why.

Backend options (`Plan.backend_options`, see `accelab.plan.backend_options.OPTION_KEYS`):
    onnxruntime  ort_fusion on|off, ort_opt_level 0|1|2|99, ort_quant none|int8-dynamic,
                 ort_per_channel on|off, ort_reduce_range on|off, ort_quant_ops all|matmul|attention,
                 ort_provider auto|cpu|cuda
    openvino     ov_precision f32|bf16, ov_hint LATENCY|THROUGHPUT (forward passes); text generation runs
                 OpenVINO GenAI's ContinuousBatchingPipeline in its own venv and process
                 (accelab.backends.openvino_genai): ov_weights fp32|int8|int4, ov_kv_precision
                 same|u8|bf16|f32, ov_max_num_seqs N, ov_max_num_batched_tokens N, ov_kv_cache_gib N,
                 ov_prefix_caching on|off
    llamacpp     llama_threads N, n_ctx N, n_batch N, llama_quant gguf|q4_0|q4_0-pure|q8_0
    vllm         vllm_dtype, vllm_mode eager|compiled, vllm_max_num_seqs N, vllm_max_num_batched_tokens N,
                 vllm_block_size, vllm_prefix_caching on|off, vllm_kv_cache_gib N, vllm_max_model_len N
                 (vLLM runs in its own venv and process: see accelab.backends.vllm)
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from accelab.backends import export, openvino_genai, vllm
from accelab.catalog.spec import ModelSpec
from accelab.plan.backend_options import OvOptions
from accelab.plan.plan import Plan
from accelab.plan.runtime import Runnable, Unsupported
from accelab.plan.techniques.system import threads_for

log = logging.getLogger(__name__)

__all__ = ["BACKENDS", "INSTALL", "is_installed", "load_backend"]

BackendName = Literal["onnxruntime", "openvino", "llamacpp", "vllm"]

# backend -> (import name, how to install it)
INSTALL: dict[BackendName, tuple[str, str]] = {
    "onnxruntime": ("onnxruntime", "pip install onnxruntime"),
    "openvino": ("openvino", "pip install openvino"),
    "llamacpp": (
        "llama_cpp",
        'CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python (or pip install -e ".[llamacpp]"); '
        "it compiles llama.cpp, about 7 min on 2 cores",
    ),
    "vllm": ("vllm", "make vllm (vLLM gets its own venv, .venv-vllm: see accelab.backends.vllm_launch)"),
}


def is_installed(backend: BackendName) -> bool:
    return importlib.util.find_spec(INSTALL[backend][0]) is not None


def _graph_check(spec: ModelSpec, plan: Plan, device: torch.device) -> None:
    export.check_task(spec)


def _openvino_check(spec: ModelSpec, plan: Plan, device: torch.device) -> None:
    from accelab.backends.openvino import check_device

    if spec.task == "text-generation":
        openvino_genai.check_model(spec, device)
        return
    generation_only = OvOptions.parse(plan.option).generation_only()
    if generation_only:
        raise Unsupported(
            f"{', '.join(generation_only)}: options of OpenVINO GenAI's text generation; {spec.name} is "
            f"{spec.task}, which runs as one compiled forward graph (ov_precision, ov_hint)"
        )
    _graph_check(spec, plan, device)
    check_device(device)


def _openvino_installed(spec: ModelSpec, plan: Plan, device: torch.device) -> None:
    """Generation needs OpenVINO GenAI's venv; forward passes the openvino package here."""
    if spec.task == "text-generation":
        openvino_genai.check_install()
    elif not is_installed("openvino"):
        raise Unsupported(
            f"backend openvino needs the openvino package, which is not installed: {INSTALL['openvino'][1]}"
        )


def _llamacpp_check(spec: ModelSpec, plan: Plan, device: torch.device) -> None:
    from accelab.backends.llamacpp import check_model

    check_model(spec)


def _vllm_check(spec: ModelSpec, plan: Plan, device: torch.device) -> None:
    vllm.check_model(spec, device)


def _vllm_installed(spec: ModelSpec, plan: Plan, device: torch.device) -> None:
    vllm.check_install(device)


def _vllm(spec: ModelSpec, plan: Plan, device: torch.device) -> Runnable:
    return vllm.load(spec, plan, device)


def _onnxruntime(spec: ModelSpec, plan: Plan, device: torch.device) -> Runnable:
    from accelab.backends import onnxruntime

    return onnxruntime.load(spec, plan, device, threads_for(plan))


def _openvino(spec: ModelSpec, plan: Plan, device: torch.device) -> Runnable:
    from accelab.backends import openvino

    if spec.task == "text-generation":
        return openvino_genai.load(spec, plan, device)
    return openvino.load(spec, plan, device, threads_for(plan))


def _llamacpp(spec: ModelSpec, plan: Plan, device: torch.device) -> Runnable:
    from accelab.backends import llamacpp

    return llamacpp.load(spec, plan, device)


Check = Callable[[ModelSpec, Plan, torch.device], None]
Load = Callable[[ModelSpec, Plan, torch.device], Runnable]

# Plan fields a backend honours; any other change from the baseline is torch's (autocast, compile, ...)
_BACKEND_FIELDS = {"backend", "backend_options", "threads", "batch_size", "placement", "server"}


@dataclass(frozen=True, kw_only=True, slots=True)
class Backend:
    """A runtime's entry in `accelab.runtimes.RUNTIMES`: its check, then its loader."""

    name: BackendName
    model_check: Check  # can it serve this model and device? without importing the runtime
    loader: Load
    # is it installed? raises Unsupported with the reason; None: its package imports in this venv
    install_check: Check | None = None

    def check(self, spec: ModelSpec, plan: Plan, device: torch.device) -> None:
        # what the model and device allow first: that reason holds whether or not the runtime is installed
        self.model_check(spec, plan, device)
        if self.install_check is not None:
            self.install_check(spec, plan, device)
        elif not is_installed(self.name):
            module, command = INSTALL[self.name]
            raise Unsupported(f"backend {self.name} needs the {module} package, which is not installed: {command}")
        torch_only = [f for f in plan.differs_from_baseline() if f not in _BACKEND_FIELDS]
        if torch_only:
            raise Unsupported(
                f"backend={self.name} runs its own graph: the torch fields {', '.join(torch_only)} of this plan "
                "would not apply; drop them, or use the backend's options "
                "(e.g. ort_quant=int8-dynamic, ov_precision=bf16)"
            )

    def load(self, spec: ModelSpec, plan: Plan, device: torch.device) -> Runnable:
        log.info("loading %s on backend %s with %s", spec.name, self.name, dict(plan.backend_options) or "defaults")
        return self.loader(spec, plan, device)


BACKENDS: dict[BackendName, Backend] = {
    "onnxruntime": Backend(name="onnxruntime", model_check=_graph_check, loader=_onnxruntime),
    "openvino": Backend(
        name="openvino", model_check=_openvino_check, loader=_openvino, install_check=_openvino_installed
    ),
    "llamacpp": Backend(name="llamacpp", model_check=_llamacpp_check, loader=_llamacpp),
    "vllm": Backend(name="vllm", model_check=_vllm_check, loader=_vllm, install_check=_vllm_installed),
}


def load_backend(spec: ModelSpec, plan: Plan, device: torch.device) -> Runnable:
    """The Runnable of `spec` on `plan.backend`; Unsupported (with the reason) when it cannot run."""
    backend = None if plan.backend == "torch" else BACKENDS.get(plan.backend)
    if backend is None:
        raise ValueError(f"backend={plan.backend!r} is not one of {', '.join(BACKENDS)} (torch runs without one)")
    backend.check(spec, plan, device)
    return backend.load(spec, plan, device)
