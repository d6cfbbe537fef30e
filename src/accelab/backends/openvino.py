"""OpenVINO: the same cached ONNX export, compiled for the CPU plugin.

Precision is explicit (`ov_precision`, f32 by default): left alone, OpenVINO runs bf16 on CPUs
with AVX512-BF16 or AMX, a precision change the plan did not ask for.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from accelab.backends.export import onnx_graph
from accelab.backends.graph_model import GraphModel, graph_runnable, model_config
from accelab.catalog.spec import ModelSpec
from accelab.plan.backend_options import OvOptions
from accelab.plan.plan import Plan
from accelab.plan.runtime import Runnable, Unsupported

log = logging.getLogger(__name__)


def load(spec: ModelSpec, plan: Plan, device: torch.device, threads: int) -> Runnable:
    import openvino as ov

    options = OvOptions.parse(plan.option)
    check_device(device)
    core = ov.Core()
    check_precision(options, core.get_property("CPU", "OPTIMIZATION_CAPABILITIES"))

    # 1. the exported graph (cached)
    graph = onnx_graph(spec)

    # 2. compile it for the CPU plugin
    config = {
        "INFERENCE_PRECISION_HINT": options.precision,
        "INFERENCE_NUM_THREADS": threads,
        "PERFORMANCE_HINT": options.hint,
    }
    compiled = core.compile_model(core.read_model(str(graph.path)), "CPU", config)
    request = compiled.create_infer_request()
    log.info("openvino compiled %s with %s", graph.path, config)

    def run(feeds: dict[str, Any]) -> Any:
        # share_inputs: no copy of the numpy feeds; the output is copied (the request reuses it)
        return request.infer(feeds, share_inputs=True)[0]

    notes = [
        f"OpenVINO {ov.__version__} CPU plugin, {options.precision}, {threads} threads, {options.hint} hint",
        f"ONNX graph {graph.directory.name} (legacy exporter{'' if spec.custom else ', eager attention'})",
    ]
    return graph_runnable(spec, plan, device, GraphModel(run, graph, model_config(spec), "openvino"), graph, notes)


def check_device(device: torch.device) -> None:
    if device.type != "cpu":
        raise Unsupported(
            f"accelab runs OpenVINO on its CPU plugin; this run is on {device} (OpenVINO's GPU plugin is for "
            "Intel GPUs): use --device cpu"
        )


def check_precision(options: OvOptions, capabilities: list[str]) -> None:
    if options.precision == "bf16" and "BF16" not in capabilities:
        raise Unsupported(
            "ov_precision=bf16 needs a CPU with native bf16 (AVX512-BF16 or AMX); OpenVINO reports "
            f"{', '.join(capabilities)} here: use ov_precision=f32"
        )
