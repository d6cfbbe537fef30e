"""One seam for loading a runnable: `load_runnable(spec, plan, device)`, over a table of runtimes.

torch's entry is `plan.apply.apply_plan` (the techniques in their fixed order); ONNX Runtime,
OpenVINO and llama.cpp register theirs in `accelab.backends`. This module sits above both, so
`plan/` imports nothing from the backends. `check_supported` asks the same table before anything
is loaded: the torch techniques every plan uses, then the runtime's own check (what the model and
device allow, whether its package is installed), so tune and predict prune a plan without
starting a process for it.

The same table says how `accelab serve` runs a plan (`serve_path`): which engine wraps the
model, and who schedules its work: an engine process that schedules generation itself (vLLM,
OpenVINO GenAI), accelab's continuous worker over a step engine (torch's paged engine, or
llama.cpp's sequences of one context), or the batch worker (encoders, classifiers; generation
where no step engine runs). The server loads through `load_runnable` on every path; a runtime
whose engine process generates is given the server's options for it (`EngineProcess`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from accelab.backends import BACKENDS, openvino_genai, vllm
from accelab.catalog.facts import GENERATE_TASKS
from accelab.catalog.spec import ModelSpec
from accelab.plan import apply
from accelab.plan.apply import check_techniques
from accelab.plan.plan import Plan
from accelab.plan.runtime import Runnable, Unsupported

__all__ = [
    "RUNTIMES",
    "EngineProcess",
    "Runtime",
    "ServePath",
    "check_supported",
    "load_runnable",
    "serve_path",
    "Unsupported",
]

Check = Callable[[ModelSpec, Plan, torch.device], None]
Load = Callable[[ModelSpec, Plan, torch.device], Runnable]
StepKind = Literal["torch", "llamacpp"]
# who schedules a served model's jobs: its engine process, accelab's continuous worker, or its batch worker
WorkerKind = Literal["engine", "continuous", "batches"]


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineProcess:
    """What a server asks of an engine process that generates for it."""

    keep_s: float = 0.0  # how long it outlives its last client: 0, it leaves with the server
    max_num_seqs: int | None = None  # sequences at once where the plan leaves it to the engine


ProcessLoad = Callable[..., Runnable]  # (spec, plan, device, *, keep_s, max_num_seqs) -> Runnable


@dataclass(frozen=True, kw_only=True, slots=True)
class Runtime:
    check: Check  # raises Unsupported (with the reason) when it cannot run this model here
    load: Load
    # generation in an engine process that schedules its own steps: the tasks, and its loader with
    # the server's options (accelab serve); other runs load it through `load`
    process_tasks: frozenset[str] = frozenset()
    process_load: ProcessLoad | None = None
    steps: StepKind | None = None  # the step engine accelab's continuous worker drives for generation


@dataclass(frozen=True, kw_only=True, slots=True)
class ServePath:
    """How `accelab serve` runs a model under a plan."""

    engine: Literal["engine-process", "generation", "embedding", "classification"]
    worker: WorkerKind  # who schedules: the engine process, or accelab's workers (accelab.serve.state starts it)
    steps: StepKind | None = None  # the continuous worker's step engine; None: generation runs per batch


_ENGINE_OF_TASK: dict[str, Literal["generation", "embedding", "classification"]] = {
    **dict.fromkeys(GENERATE_TASKS, "generation"),
    "feature-extraction": "embedding",
    "image-classification": "classification",
}


def _torch_load(spec: ModelSpec, plan: Plan, device: torch.device) -> Runnable:
    return apply.apply_plan(spec, plan, device)


def _no_check(spec: ModelSpec, plan: Plan, device: torch.device) -> None:
    return None


_GENERATION = frozenset({"text-generation"})


def _table() -> dict[str, Runtime]:
    table = {"torch": Runtime(check=_no_check, load=_torch_load, steps="torch")}
    table.update({name: Runtime(check=entry.check, load=entry.load) for name, entry in BACKENDS.items()})
    table["llamacpp"] = Runtime(check=BACKENDS["llamacpp"].check, load=BACKENDS["llamacpp"].load, steps="llamacpp")
    for entry, process_load in ((BACKENDS["vllm"], vllm.load), (BACKENDS["openvino"], openvino_genai.load)):
        table[entry.name] = Runtime(
            check=entry.check, load=entry.load, process_tasks=_GENERATION, process_load=process_load
        )
    return table


RUNTIMES: dict[str, Runtime] = _table()


def _runtime(plan: Plan) -> Runtime:
    runtime = RUNTIMES.get(plan.backend)
    if runtime is None:
        raise ValueError(f"backend={plan.backend!r} is not one of {', '.join(RUNTIMES)}")
    return runtime


def check_supported(plan: Plan, spec: ModelSpec, device: torch.device) -> None:
    """Raise Unsupported before loading anything when the plan cannot run here."""
    check_techniques(plan, spec, device)
    _runtime(plan).check(spec, plan, device)


def load_runnable(
    spec: ModelSpec, plan: Plan, device: torch.device, *, process: EngineProcess | None = None
) -> Runnable:
    """`spec` loaded and accelerated by `plan` on `device`; Unsupported when it cannot run here.
    `process`: a server's options for the engine process of a runtime that generates in one."""
    check_supported(plan, spec, device)
    runtime = _runtime(plan)
    if process is not None and runtime.process_load is not None and spec.task in runtime.process_tasks:
        return runtime.process_load(spec, plan, device, keep_s=process.keep_s, max_num_seqs=process.max_num_seqs)
    return runtime.load(spec, plan, device)


def serve_path(spec: ModelSpec, plan: Plan) -> ServePath:
    """The engine and the worker `accelab serve` runs `spec` with under `plan`."""
    runtime = _runtime(plan)
    if spec.task in runtime.process_tasks:
        return ServePath(engine="engine-process", worker="engine")
    engine = _ENGINE_OF_TASK.get(spec.task)
    if engine is None:
        served = ", ".join(_ENGINE_OF_TASK)
        raise ValueError(f"accelab serve has no engine for task {spec.task!r}; tasks served: {served}")
    if engine != "generation":
        return ServePath(engine=engine, worker="batches")
    return ServePath(engine=engine, worker="continuous" if runtime.steps else "batches", steps=runtime.steps)
