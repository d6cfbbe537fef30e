"""The user's nn.Module behind the call shape the rest of accelab uses: keyword tensors in (the
names of its inputs, `custom_inputs.Call`), floating inputs cast to the weights' dtype, and an
output with `.logits` out, plus the few config facts accelab reads from a transformers model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from accelab.catalog.custom_inputs import Call


@dataclass
class CustomOutput:
    """The custom model's main output tensor as `.logits` (class scores or embeddings)."""

    logits: torch.Tensor


class _Config:
    """The few config facts accelab reads from a transformers model: class names (none given:
    predictions and servers name classes by index)."""

    def __init__(self, labels: list[str] | None):
        self.id2label = dict(enumerate(labels or []))
        self.model_type = "custom"


class CustomModule(torch.nn.Module):
    """A user's nn.Module called the way accelab calls models: `model(**batch)` with the
    input names of `call`, floating inputs cast to the weights' dtype (bf16-weights plans),
    and the main output tensor returned as `.logits`."""

    def __init__(self, model: torch.nn.Module, call: Call, task: str, labels: list[str] | None = None):
        super().__init__()
        self.model = model
        self.call = call
        self.task = task
        self.config = _Config(labels)

    def forward(self, return_dict: bool = True, **inputs: torch.Tensor) -> CustomOutput:
        # return_dict: transformers' call convention (the ONNX export passes it); always an output object
        dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), None)
        cast = {
            k: v.to(dtype) if dtype is not None and torch.is_tensor(v) and v.is_floating_point() else v
            for k, v in inputs.items()
        }
        args = [cast[key] for key in self.call.keys]
        out = self.model(**dict(zip(self.call.params, args))) if self.call.params else self.model(*args)
        return CustomOutput(logits=_main_tensor(out))


def _main_tensor(out: Any) -> torch.Tensor:
    if torch.is_tensor(out):
        return out
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, dict) and out:
        return next(iter(out.values()))
    if isinstance(out, (tuple, list)) and out and torch.is_tensor(out[0]):
        return out[0]
    raise TypeError(
        f"the custom model returned a {type(out).__name__}; return a tensor (or a tuple whose first item is one)"
    )
