"""Engines: what the server runs. `build_engine` loads a model under a plan through
`accelab.runtimes.load_runnable` and wraps it in the engine its serve path names
(`accelab.runtimes.serve_path`), which carries the path's worker (`Engine.worker`: the server starts
that one); tests inject fakes with the same methods (see tests/fakes_serve.py).

The package itself imports no engine: `from accelab.serve.engines.base import ...` runs this file
first, and the engines import the model runner, which imports `engines.base` back (imported first,
the runner would meet itself half initialised)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from accelab.catalog.spec import ModelSpec
    from accelab.plan.plan import Plan
    from accelab.serve.engines.interfaces import Engine


def build_engine(
    spec: ModelSpec, plan: Plan, device: torch.device, *, name: str, max_batch_size: int | None = None
) -> Engine:
    """`spec` under `plan` on `device`, in the engine of its serve path; an engine process that
    schedules itself belongs to this server (it leaves with it) and runs up to `max_batch_size`
    sequences where the plan does not say."""
    from accelab.runtimes import EngineProcess, load_runnable, serve_path
    from accelab.serve.engines.encoders import HFClassificationEngine, HFEmbeddingEngine
    from accelab.serve.engines.generation import HFGenerationEngine
    from accelab.serve.engines.vllm import EngineProcessEngine

    path = serve_path(spec, plan)
    if path.engine == "engine-process":
        runnable = load_runnable(spec, plan, device, process=EngineProcess(max_num_seqs=max_batch_size))
        return EngineProcessEngine(runnable, name=name)
    runnable = load_runnable(spec, plan, device)
    if path.engine == "generation":
        return HFGenerationEngine(runnable, name=name, steps=path.steps, worker=path.worker)
    if path.engine == "embedding":
        return HFEmbeddingEngine(runnable, name=name)
    return HFClassificationEngine(runnable, name=name)
