"""Load a resolved ModelSpec: the model (eval mode, fp32 by default) and its processor."""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Any

import torch

from accelab.catalog import custom
from accelab.catalog.facts import MODEL_CLASSES
from accelab.catalog.spec import ModelSpec

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Loaded:
    """A loaded model. `processor` is the tokenizer (text models), the image processor
    (classifiers) or the AutoProcessor (vision-language models)."""

    model: Any
    processor: Any
    spec: ModelSpec


def load(
    spec: ModelSpec,
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    **from_pretrained_kwargs: Any,
) -> Loaded:
    """Load `spec` offline. Extra kwargs (device_map, max_memory, offload_folder, ...) go to the
    model's `from_pretrained`. fp32 unless `dtype` says otherwise (transformers 5 would keep
    the checkpoint's dtype)."""
    if spec.custom:
        return _load_custom(spec, dtype, attn_implementation, from_pretrained_kwargs)
    import transformers

    kwargs = dict(from_pretrained_kwargs, dtype=dtype)
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if spec.gguf_file:
        kwargs["gguf_file"] = spec.gguf_file
    kwargs.update(_remote_code(spec))

    # Model
    model_class = getattr(transformers, MODEL_CLASSES[spec.task])
    log.info("loading %s (%s) from %s with %s", spec.name, spec.task, spec.source, model_class.__name__)
    model = model_class.from_pretrained(spec.source, **kwargs).eval()

    # Processor
    processor = load_processor(spec)
    return Loaded(model=model, processor=processor, spec=spec)


def _load_custom(spec: ModelSpec, dtype: torch.dtype, attn_implementation: str | None, kwargs: dict) -> Loaded:
    # the technique checks refuse these for custom models first; this is the last line
    options = [*(["attn_implementation"] if attn_implementation is not None else []), *kwargs]
    if options:
        raise ValueError(
            f"{spec.name} is a custom nn.Module: transformers' load options ({', '.join(options)}) do not apply"
        )

    log.info("building the custom model %s (%s)", spec.name, spec.task)
    model, inputs = custom.load(spec, dtype)
    return Loaded(model=model, processor=inputs, spec=spec)


def load_processor(spec: ModelSpec) -> Any:
    if spec.custom:
        return custom.load(spec)[1]
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    if spec.task == "image-classification":
        return AutoImageProcessor.from_pretrained(spec.source, **_image_backend(), **_remote_code(spec))
    if spec.task == "image-text-to-text":
        return AutoProcessor.from_pretrained(spec.source, **_image_backend(), **_remote_code(spec))
    gguf = {"gguf_file": spec.gguf_file} if spec.gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(spec.source, **gguf, **_remote_code(spec))
    if tokenizer.pad_token is None:  # batching needs one; eos is the usual choice for causal LMs
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    if spec.task == "text-generation":
        tokenizer.padding_side = "left"  # generate() continues from the last position of each row
    return tokenizer


def _remote_code(spec: ModelSpec) -> dict:
    # only when the user allowed it (resolve checked the flag); absent otherwise, so transformers
    # keeps refusing code from a repository on its own
    return {"trust_remote_code": True} if spec.trust_remote_code else {}


def _image_backend() -> dict:
    # Without torchvision (the CPU torch 2.13 setup) transformers falls back to the PIL image
    # processors with a warning each time; ask for them directly there.
    return {} if importlib.util.find_spec("torchvision") else {"backend": "pil"}
