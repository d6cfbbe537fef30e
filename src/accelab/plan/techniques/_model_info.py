"""What the technique checks need to know about a model before it is loaded.

Everything here reads the model's config (local files only, no Hub) and, where the layer
structure matters, builds the model on the meta device: no weights are read or allocated.
A spec whose config cannot be read (an unusual checkpoint) gives None, and the checks that
need it step aside: loading will then fail with transformers' own message.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

from accelab.catalog.facts import MODEL_CLASSES
from accelab.catalog.spec import ModelSpec
from accelab.plan.runtime import Unsupported

log = logging.getLogger(__name__)


def needs_transformers(spec: ModelSpec, what: str) -> None:
    """Unsupported for a custom nn.Module, naming what needs a transformers model and why."""
    if spec.custom:
        raise Unsupported(f"{what} needs a transformers model; {spec.name} is a custom nn.Module")


def load_config(spec: ModelSpec) -> Any | None:
    if spec.custom:
        return None  # a custom nn.Module has no transformers config
    from transformers import AutoConfig

    kwargs = {"gguf_file": spec.gguf_file} if spec.gguf_file else {}
    try:
        return AutoConfig.from_pretrained(spec.source, local_files_only=True, **kwargs)
    except (OSError, ValueError, KeyError, ImportError) as exc:
        log.debug("no config for %s (%s): %s", spec.name, spec.source, exc)
        return None


def model_class(spec: ModelSpec, config: Any) -> type[PreTrainedModel] | None:
    """The class `from_pretrained` will build for this task and config."""
    import transformers

    auto = getattr(transformers, MODEL_CLASSES[spec.task])
    try:
        return auto._model_mapping[type(config)]
    except (KeyError, ValueError):
        return None


def architecture(spec: ModelSpec, config: Any | None) -> str:
    """A short name for messages: the config's model_type ("resnet"), else the spec name."""
    return getattr(config, "model_type", None) or spec.name


def meta_model(spec: ModelSpec, config: Any, dtype: torch.dtype = torch.float32) -> torch.nn.Module | None:
    """The model with every parameter on the meta device (layer structure and sizes, no data)."""
    cls = model_class(spec, config)
    if cls is None:
        return None
    with torch.device("meta"):
        return cls._from_config(config, dtype=dtype)
