"""A compiled graph (ORT session, OpenVINO compiled model) behind the call shape of a
transformers model: `model(**batch)` with torch tensors in, a ModelOutput of torch tensors out.

The bench engine, the quality guard and the catalog's batch builders only need that call, the
model's `config` and a `forward` to inspect, so they run a backend exactly as they run torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig
from transformers.modeling_outputs import BaseModelOutput, ImageClassifierOutput

from accelab.backends.export import Graph
from accelab.catalog.custom import load
from accelab.catalog.load import load_processor
from accelab.catalog.spec import ModelSpec
from accelab.plan.plan import Plan
from accelab.plan.runtime import Runnable

Runner = Callable[[dict[str, np.ndarray]], np.ndarray]  # feeds -> the graph's one output


class GraphModel:
    """Calls `run(feeds)` on numpy copies of the graph's inputs; extra batch keys are ignored."""

    def __init__(self, run: Runner, graph: Graph, config: Any, runtime: str):
        self.run = run
        self.graph = graph
        self.config = config
        self.runtime = runtime

    def __call__(self, **batch: Any) -> BaseModelOutput | ImageClassifierOutput:
        return self.forward(**batch)

    def forward(self, **batch: Any) -> BaseModelOutput | ImageClassifierOutput:
        feeds = {name: self._feed(name, batch) for name in self.graph.input_names}
        out = torch.from_numpy(np.ascontiguousarray(self.run(feeds)))
        if self.graph.output_name == "logits":
            return ImageClassifierOutput(logits=out)  # [B, num_labels]
        return BaseModelOutput(last_hidden_state=out)  # [B, S, H]

    def _feed(self, name: str, batch: dict[str, Any]) -> np.ndarray:
        if name not in batch:
            raise ValueError(
                f"the {self.runtime} graph of this model needs input {name!r}; the batch has {', '.join(batch)}"
            )
        value = batch[name]
        array = value.detach().cpu().numpy() if torch.is_tensor(value) else np.asarray(value)
        expected = self.graph.static_dims.get(name, [])
        for axis, size in enumerate(expected):
            if size is not None and axis < array.ndim and array.shape[axis] != size:
                raise ValueError(
                    f"{name} has shape {list(array.shape)}, but the exported graph fixes axis {axis} at {size} "
                    f"(the size it was exported with); pass inputs of that size, or run it with backend=torch"
                )
        if array.dtype == np.int32:  # the exporter traced int64 ids and masks
            array = array.astype(np.int64)
        return array

    def __repr__(self) -> str:
        return f"GraphModel({self.runtime}, {self.graph.path})"


def model_config(spec: ModelSpec) -> Any:
    """The transformers config (the batch builders read max positions and image size from it);
    a custom model's stand-in (its class names)."""
    if spec.custom:
        return load(spec)[0].config

    gguf = {"gguf_file": spec.gguf_file} if spec.gguf_file else {}
    return AutoConfig.from_pretrained(spec.source, **gguf)


def graph_runnable(
    spec: ModelSpec, plan: Plan, device: torch.device, model: GraphModel, graph: Graph, notes: list[str]
) -> Runnable:
    """The Runnable around a graph model (shared with OpenVINO); closing it drops the session."""
    runnable = Runnable(
        model=model,
        processor=load_processor(spec),
        device=device,
        task=spec.task,
        notes=notes,
        weight_bytes=graph.weight_bytes(),
        spec=spec,
        plan=plan,
    )
    runnable.exit_stack.callback(_release, model)
    return runnable


def _release(model: GraphModel) -> None:
    def closed(feeds: Any) -> Any:
        raise RuntimeError("this backend session was closed with its Runnable")

    model.run = closed  # the lambda held the only reference to the session: this frees it
