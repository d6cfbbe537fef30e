"""Custom models: a plain `nn.Module` from the user's own code, behind the same Loaded view.

Two ways in:
- `accelab bench mypkg.models:build`: a callable that returns the model, or a `CustomModel`
  (or a dict with the same keys) that also names its example inputs and task. Every process
  (each plan's child, the fp32 reference, torchrun workers) calls it again, with torch seeded
  to 0, so a randomly initialised model has the same weights in all of them.
- From Python, a model object (`accelab.bench(my_module, inputs=...)`): it is written once with
  cloudpickle (classes defined in a notebook or `__main__` travel by value) and each process
  loads that file.

A custom model runs behind `CustomModule` (`custom_module`), which gives it the call shape the
rest of accelab uses, and its inputs come from `CustomInputs` (`custom_inputs`), in place of a
tokenizer or image processor.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import cloudpickle
import torch

from accelab.catalog.custom_inputs import CustomInputs, Inputs, as_named, example_of, image_shaped
from accelab.catalog.custom_module import CustomModule

log = logging.getLogger(__name__)

CustomTask = Literal["image-classification", "feature-extraction"]
CUSTOM_TASKS: tuple[CustomTask, ...] = get_args(CustomTask)
PICKLE_PREFIX = "pickle:"
_TARGET = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


@dataclass(kw_only=True)
class CustomModel:
    """What a builder may return instead of the bare model.

    `inputs`: an example call with a batch dimension first (any batch size: accelab repeats or
    cuts it to the batch it measures), as a tensor, a tuple of tensors (positional arguments),
    a dict of tensors (keyword arguments), or a callable `batch_size -> inputs`. None: an image
    classifier taking [B, 3, 224, 224].
    `task`: image-classification or feature-extraction (default: image-classification for
    image-shaped inputs, else feature-extraction).
    `labels`: class names, for servers and predictions (default: classes are named by index).
    """

    model: torch.nn.Module
    inputs: Inputs = None
    task: str | None = None
    labels: list[str] | None = None


def is_target(text: str) -> bool:
    """True for "package.module:callable" (a builder), the one form resolve treats as code."""
    return bool(_TARGET.match(text))


# -- resolve: what the user named -> the parts of a ModelSpec ------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class Resolved:
    builder: str
    source: str  # the directory put first on sys.path to import it (or the pickle file)
    task: CustomTask
    origin: str


def resolve_target(target: str, task: str | None) -> Resolved:
    """Import `target` (from the current directory too, as `python -m` would) and build it once,
    here, to learn its task and check it returns a model: errors surface before any child starts."""
    root = os.getcwd()
    built = _call_builder(target, root)
    chosen = _choose_task(built, task, target)
    # the weights' digest is part of the spec, so cached references and exports follow a retrained
    # checkpoint that the builder loads (its module file alone would not change)
    return Resolved(
        builder=target,
        source=root,
        task=chosen,
        origin=f"custom model {target} (from {root}; weights {_digest(built)})",
    )


def _digest(bundle: CustomModel) -> str:
    """sha256 of the model's parameters and buffers and of its example inputs."""
    digest = hashlib.sha256()
    tensors = list(bundle.model.state_dict().items())
    example = example_of(bundle.inputs, 1)
    tensors += list(as_named(example)[0].items()) if example is not None else []
    for name, tensor in tensors:
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        try:
            digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        except (RuntimeError, TypeError):  # a tensor subclass without plain storage: its values as floats
            digest.update(tensor.detach().cpu().float().numpy().tobytes())
    return digest.hexdigest()[:12]


def save_object(
    model: Any, *, inputs: Inputs = None, task: str | None = None, labels: list[str] | None = None, directory: Path
) -> Resolved:
    """Write a model object (with its inputs) once with cloudpickle; the file's name is the hash
    of its bytes, so the same object twice is one file (and one cached fp32 reference)."""
    bundle = (
        model if isinstance(model, CustomModel) else CustomModel(model=model, inputs=inputs, task=task, labels=labels)
    )
    _check_model(bundle.model, type(bundle.model).__name__)
    chosen = _choose_task(bundle, task or bundle.task, type(bundle.model).__name__)
    blob = cloudpickle.dumps(bundle)
    path = directory / f"{hashlib.sha256(blob).hexdigest()[:20]}.pkl"
    if not path.is_file():
        directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(blob)
        tmp.replace(path)  # atomic: a reader never sees half a model
    return Resolved(
        builder=PICKLE_PREFIX + str(path),
        source=str(path),
        task=chosen,
        origin=f"model object {type(bundle.model).__name__} (saved as {path.name})",
    )


def files_of(builder: str, source: str) -> list[Path]:
    """The files whose change makes a custom model another model (for cache keys)."""
    if builder.startswith(PICKLE_PREFIX):
        return [Path(builder[len(PICKLE_PREFIX) :])]
    module = builder.split(":", 1)[0]
    _on_path(source)
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return []
    return [Path(found.origin)] if found and found.origin and Path(found.origin).is_file() else []


# -- load: in every process -----------------------------------------------------------------------
def load(spec: Any, dtype: torch.dtype = torch.float32) -> tuple[CustomModule, CustomInputs]:
    """The model (eval mode, weights in `dtype`) behind `CustomModule`, and its inputs."""
    bundle = build(spec.builder, spec.source)
    model = bundle.model.eval()
    if dtype != torch.float32:
        model = model.to(dtype)
    inputs = CustomInputs.from_example(bundle.inputs, spec.task)
    return CustomModule(model, inputs.call, spec.task, bundle.labels), inputs


def build(builder: str, source: str) -> CustomModel:
    if builder.startswith(PICKLE_PREFIX):
        path = Path(builder[len(PICKLE_PREFIX) :])
        if not path.is_file():
            raise ValueError(
                f"the saved model object {path} is gone (the accelab cache was cleared?); pass the model again"
            )
        return cloudpickle.loads(path.read_bytes())
    return _call_builder(builder, source)


def _on_path(directory: str) -> None:
    if directory and directory not in sys.path:
        sys.path.insert(0, directory)


def _call_builder(target: str, root: str) -> CustomModel:
    module_name, _, attr = target.partition(":")
    _on_path(root)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise ValueError(
            f"cannot import {module_name!r} for the custom model {target!r}: {err}. Run accelab from the directory "
            "that holds the package (or add it to PYTHONPATH); the form is package.module:callable"
        ) from err
    fn: Any = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ValueError(f"{module_name} has no {attr!r} (from the custom model {target!r})")
    if not callable(fn):
        raise ValueError(f"{target} is a {type(fn).__name__}, not a callable that returns a model")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # every process builds the same random weights
        made = fn()
    bundle = as_bundle(made, target)
    _check_model(bundle.model, target)
    return bundle


def as_bundle(made: Any, where: str) -> CustomModel:
    if isinstance(made, CustomModel):
        return made
    if isinstance(made, torch.nn.Module):
        return CustomModel(model=made)
    if isinstance(made, dict) and "model" in made:
        unknown = set(made) - {"model", "inputs", "task", "labels"}
        if unknown:
            raise ValueError(
                f"{where} returned a dict with unknown keys {sorted(unknown)}; allowed: model, inputs, task, labels"
            )
        return CustomModel(**made)
    raise ValueError(
        f"{where} returned a {type(made).__name__}; return a torch.nn.Module, an accelab.CustomModel or "
        "a dict with keys model (and optionally inputs, task, labels)"
    )


def _check_model(model: Any, where: str) -> None:
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"{where}: the model is a {type(model).__name__}, not a torch.nn.Module")


def _choose_task(bundle: CustomModel, task: str | None, where: str) -> CustomTask:
    chosen = task or bundle.task
    if chosen is None:
        chosen = "image-classification" if image_shaped(example_of(bundle.inputs, 1)) else "feature-extraction"
    for known in CUSTOM_TASKS:
        if chosen == known:
            return known
    raise ValueError(
        f"task={chosen!r} for the custom model {where}: a custom nn.Module runs as "
        f"{' or '.join(CUSTOM_TASKS)}; generation needs a transformers model with generate()"
    )
