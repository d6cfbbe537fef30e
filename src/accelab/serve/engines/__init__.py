"""Engines: what the server runs. `build_engine` picks one by task over a Runnable;
tests inject fakes with the same methods (see tests/fakes_serve.py)."""

from __future__ import annotations

from typing import Any

from accelab.catalog.facts import GENERATE_TASKS
from accelab.serve.engines.base import ROUTES_OF_TASK, Engine


def build_engine(runnable: Any, *, name: str) -> Engine:
    from accelab.serve.engines.encoders import HFClassificationEngine, HFEmbeddingEngine
    from accelab.serve.engines.generation import HFGenerationEngine

    task = runnable.task
    if task in GENERATE_TASKS:
        return HFGenerationEngine(runnable, name=name)
    if task == "feature-extraction":
        return HFEmbeddingEngine(runnable, name=name)
    if task == "image-classification":
        return HFClassificationEngine(runnable, name=name)
    raise ValueError(f"accelab serve has no engine for task {task!r}; tasks served: {', '.join(ROUTES_OF_TASK)}")
