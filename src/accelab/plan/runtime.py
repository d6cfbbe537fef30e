"""What applying a Plan produces: a model ready to run, and how to call it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from accelab.catalog.load import Loaded


class Unsupported(Exception):
    """A technique cannot run (or would do nothing) on this device; the message says why.

    It is not an error of the user's: the Result carries status "unsupported" and this reason.
    """


@dataclass(kw_only=True)
class Runnable:
    """A loaded model after its Plan: call `forward(batch)` or `generate(batch, **kw)`.

    `context()` wraps every call (autocast, backend flags); `generate_kwargs` go to every
    `generate` call (KV cache implementation); `notes` say what each technique did.
    """

    model: Any  # torch.nn.Module, or a backend session object with the same call shape
    processor: Any
    device: torch.device
    task: str
    context: Callable[[], AbstractContextManager] = contextlib.nullcontext
    generate_kwargs: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    placement: dict[str, str] | None = None  # module -> device, where a device map placed layers
    exit_stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)  # global flags to restore
    generate_fn: Callable[..., Any] | None = None  # backends that generate without a torch model
    weight_bytes: int | None = None
    quantized_layers: int = 0  # Linear layers torchao quantized (compile then fuses their scale multiply)
    quantized_on_load: list[str] | None = None  # the layers the loader quantized, shard by shard
    spec: Any = None  # the ModelSpec it was loaded from
    plan: Any = None  # the Plan applied
    # processes outside this one that do its work (a backend's engine server): the noise meter
    # counts their CPU time, and their children's, as the measurement's own
    worker_pids: tuple[int, ...] = ()

    def as_loaded(self) -> Any:
        """The catalog's `Loaded` view (model, processor, spec), for its batch builders."""
        return Loaded(model=self.model, processor=self.processor, spec=self.spec)

    def forward(self, batch: dict[str, torch.Tensor]) -> Any:
        with torch.inference_mode(), self.context():
            return self.model(**batch)

    def generate(self, batch: dict[str, torch.Tensor], **kwargs: Any) -> Any:
        if self.generate_fn is not None:
            return self.generate_fn(batch, **{**self.generate_kwargs, **kwargs})
        with torch.inference_mode(), self.context():
            return self.model.generate(**batch, **{**self.generate_kwargs, **kwargs})

    def close(self) -> None:
        self.exit_stack.close()

    def __enter__(self) -> Runnable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def input_device(model: Any, fallback: torch.device) -> torch.device:
    """Where a batch must go: the first layer's device under a device map, else the model's."""
    device_map = getattr(model, "hf_device_map", None)
    if device_map:
        first = next(iter(device_map.values()))
        if isinstance(first, int):
            return torch.device("cuda", first)
        if first in ("cpu", "disk"):
            return torch.device("cpu")
        return torch.device(first)
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError, TypeError):
        return fallback


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    non_blocking = device.type == "cuda"
    return {k: v.to(device, non_blocking=non_blocking) if torch.is_tensor(v) else v for k, v in batch.items()}
