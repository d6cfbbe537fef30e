"""The model to train: loaded fp32, its head fitted to the dataset's labels, its processor set
to the training image size, gradient checkpointing where asked.

The checks (`label_fit`, `image_size_for`, `identity`) read only config.json, so the parent
process runs them before it starts any worker; `load_for_training` runs in each worker.
Order in `load_for_training`: load (with the head's label count), then processor size, then
gradient checkpointing. Compile is applied later by accelerate's `prepare` (dynamo plugin),
after the model is wrapped for data parallelism.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from accelab.catalog.facts import max_sequence_length
from accelab.catalog.load import load_processor
from accelab.catalog.spec import ModelSpec
from accelab.train.config import TrainConfig

log = logging.getLogger(__name__)

# config.json keys that do not change the trained tensors (label names, bookkeeping)
_IDENTITY_IGNORED = (
    "id2label",
    "label2id",
    "transformers_version",
    "_name_or_path",
    "dtype",
    "torch_dtype",
    "use_cache",
    "architectures",
    "num_labels",
    "_attn_implementation_autoset",
)


def read_model_config(source: str | Path) -> dict[str, Any]:
    path = Path(source) / "config.json"
    if not path.is_file():
        raise ValueError(f"model directory {source} has no config.json; accelab trains Hugging Face models")
    return json.loads(path.read_text())


def read_processor_config(source: str | Path) -> dict[str, Any]:
    path = Path(source) / "preprocessor_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def model_labels(model_config: dict[str, Any]) -> list[str]:
    id2label = model_config.get("id2label") or {}
    if id2label:
        return [str(id2label[k]) for k in sorted(id2label, key=int)]
    return [f"LABEL_{i}" for i in range(int(model_config.get("num_labels", 2)))]


@dataclass(frozen=True, kw_only=True, slots=True)
class LabelFit:
    """How the model's classifier head meets the dataset's classes."""

    load_kwargs: dict[str, Any] = field(default_factory=dict)  # for from_pretrained
    note: str | None = None  # a warning for people, or None


def label_fit(model_config: dict[str, Any], classes: list[str], *, reinit_head: bool, model: str) -> LabelFit:
    """ValueError when the label counts differ and --reinit-head was not given."""
    have = model_labels(model_config)
    label_maps = {"id2label": dict(enumerate(classes)), "label2id": {c: i for i, c in enumerate(classes)}}
    if len(have) != len(classes):
        if not reinit_head:
            raise ValueError(
                f"{model} has a {len(have)}-label classifier head but the dataset has {len(classes)} classes "
                f"({', '.join(classes[:10])}{' ...' if len(classes) > 10 else ''}); pass --reinit-head to replace the "
                "head with a new, randomly initialised one of the right size, or choose a model with "
                f"{len(classes)} labels"
            )
        return LabelFit(
            load_kwargs={"num_labels": len(classes), "ignore_mismatched_sizes": True, **label_maps},
            note=f"classifier head of {model} re-initialised: {len(have)} -> {len(classes)} labels",
        )
    if have != classes:
        note = None
        if not all(name.startswith("LABEL_") for name in have) and set(have) != set(classes):
            note = (
                f"{model}'s labels ({', '.join(have[:5])}...) are renamed to the dataset's classes "
                f"({', '.join(classes[:5])}...): the head is fine-tuned to the new meaning"
            )
        return LabelFit(load_kwargs=label_maps, note=note)
    return LabelFit()


def _processor_side(processor_config: dict[str, Any]) -> int | None:
    size = processor_config.get("size") or {}
    if isinstance(size, int):
        return size
    return size.get("height") or size.get("shortest_edge")


def image_size_for(
    model_config: dict[str, Any], processor_config: dict[str, Any], requested: int | None, model: str
) -> int:
    """The training image side: the model's fixed size (ViT-like configs carry `image_size`),
    else --image-size, else the processor's size."""
    fixed = model_config.get("image_size")
    if isinstance(fixed, int):
        if requested is not None and requested != fixed:
            raise ValueError(
                f"{model} takes {fixed} px images (config.json image_size: its position embeddings are sized for "
                f"it); drop --image-size {requested}, or train a model configured for {requested} px"
            )
        return fixed
    side = requested or _processor_side(processor_config)
    if side is None:
        raise ValueError(f"cannot tell the image size of {model}; pass --image-size N")
    return int(side)


def configure_processor(processor: Any, image_size: int) -> Any:
    """Make the image processor produce image_size x image_size pixel values (and save so)."""
    size = dict(processor.size) if processor.size is not None else {}
    if size.get("shortest_edge"):
        processor.size = {"shortest_edge": image_size}
        if getattr(processor, "crop_size", None) is not None:
            processor.crop_size = {"height": image_size, "width": image_size}
    else:
        processor.size = {"height": image_size, "width": image_size}
    return processor


def identity(model_config: dict[str, Any], task: str, num_labels: int | None) -> dict[str, Any]:
    """What makes a checkpoint loadable into this run: the architecture and the head size."""
    kept = {k: v for k, v in sorted(model_config.items()) if k not in _IDENTITY_IGNORED}
    digest = hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return {"model_type": model_config.get("model_type"), "task": task, "num_labels": num_labels, "config_sha": digest}


@dataclass(kw_only=True, slots=True)
class TrainModel:
    model: Any
    processor: Any  # image processor or tokenizer
    image_size: int | None
    notes: list[str]


def load_for_training(config: TrainConfig, classes: list[str] | None) -> TrainModel:
    import transformers

    spec = ModelSpec(name=config.model, task=config.task, source=config.model_source)
    model_config = read_model_config(config.model_source)
    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if config.attention:
        kwargs["attn_implementation"] = config.attention
    notes: list[str] = []

    # Model, with a head that fits the dataset's labels
    model_class: type[transformers.AutoModelForImageClassification | transformers.AutoModelForCausalLM]
    if config.task == "image-classification":
        fit = label_fit(model_config, classes or [], reinit_head=config.reinit_head, model=config.model)
        kwargs.update(fit.load_kwargs)
        notes += [fit.note] if fit.note else []
        model_class = transformers.AutoModelForImageClassification
    else:
        model_class = transformers.AutoModelForCausalLM
        if (model_config.get("quantization_config") or {}).get("quant_method") == "gguf":
            kwargs["config"] = _without_gguf_marker(config.model_source)
            notes.append(
                f"{config.model}: the config's GGUF quantization marker is dropped; its safetensors "
                "weights are fp32, which training needs (and save_pretrained refuses GGUF models)"
            )
    log.info("loading %s from %s for training", config.model, config.model_source)
    model = model_class.from_pretrained(config.model_source, **kwargs)
    model.train()

    # Processor, producing the training image size
    processor = load_processor(spec)
    image_size = None
    if config.task == "image-classification":
        image_size = image_size_for(
            model_config, read_processor_config(config.model_source), config.image_size, config.model
        )
        configure_processor(processor, image_size)
    else:
        check_block_size(model.config, config.block_size, config.model)

    # Gradient checkpointing
    if config.gradient_checkpointing:
        enable_gradient_checkpointing(model, config.model)
    return TrainModel(model=model, processor=processor, image_size=image_size, notes=notes)


def _without_gguf_marker(source: str) -> Any:
    """The model's config minus a `quantization_config` of GGUF origin (a model dequantised from
    a GGUF to fp32 safetensors may carry it; with it, transformers refuses to save the model)."""
    from transformers import AutoConfig

    model_config = AutoConfig.from_pretrained(source)
    if hasattr(model_config, "quantization_config"):
        delattr(model_config, "quantization_config")
    return model_config


def check_block_size(model_config: Any, block_size: int, model: str) -> None:
    limit = max_sequence_length(model_config)
    if limit is not None and block_size > limit:
        raise ValueError(
            f"--block-size {block_size} is longer than {model} accepts ({limit} positions); "
            f"pass --block-size {limit} or less"
        )


def enable_gradient_checkpointing(model: Any, name: str) -> None:
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"{name} ({type(model).__name__}) does not support gradient checkpointing in transformers; "
            "drop --gradient-checkpointing (or lower --batch-size / raise --grad-accum to save memory)"
        )
    # non-reentrant: works with DDP and with inputs that do not require grad.
    # transformers >= 5.2x names it activation checkpointing; older 5.x only has the old name.
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False  # a KV cache is useless in training and conflicts with checkpointing
