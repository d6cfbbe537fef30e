"""Custom models: a plain `nn.Module` from the user's own code, behind the same Loaded view.

Two ways in:
- `accelab bench mypkg.models:build`: a callable that returns the model, or a `CustomModel`
  (or a dict with the same keys) that also names its example inputs and task. Every process
  (each plan's child, the fp32 reference, torchrun workers) calls it again, with torch seeded
  to 0, so a randomly initialised model has the same weights in all of them.
- From Python, a model object (`accelab.bench(my_module, inputs=...)`): it is written once with
  cloudpickle (classes defined in a notebook or `__main__` travel by value) and each process
  loads that file.

A custom model runs behind `CustomModule`, which gives it the call shape the rest of accelab
uses: keyword tensors in (the names of its inputs), an output with `.logits` out. Its inputs
come from `CustomInputs`, in place of a tokenizer or image processor:
- image-classification (inputs [B, C, H, W], C = 1 or 3): the real sample photos, resized to
  H x W and normalised with the ImageNet mean and std; synthetic inputs are random images;
- feature-extraction (any other inputs): the example inputs' shapes and dtypes filled with
  seeded random values, a different row per sample (integer inputs stay below their maximum + 1).
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import cloudpickle
import torch

log = logging.getLogger(__name__)

CustomTask = Literal["image-classification", "feature-extraction"]
CUSTOM_TASKS: tuple[CustomTask, ...] = get_args(CustomTask)
PICKLE_PREFIX = "pickle:"
_TARGET = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_IMAGENET_MEAN = (0.485, 0.456, 0.406)
_IMAGENET_STD = (0.229, 0.224, 0.225)
Inputs = Any  # a tensor (the first positional argument), a tuple of tensors, a dict of named tensors,
# or a callable batch_size -> one of those


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
    example = _example(bundle.inputs, 1)
    tensors += list(_as_named(example)[0].items()) if example is not None else []
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
        chosen = "image-classification" if _image_shaped(_example(bundle.inputs, 1)) else "feature-extraction"
    for known in CUSTOM_TASKS:
        if chosen == known:
            return known
    raise ValueError(
        f"task={chosen!r} for the custom model {where}: a custom nn.Module runs as "
        f"{' or '.join(CUSTOM_TASKS)}; generation needs a transformers model with generate()"
    )


# -- inputs ---------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class Call:
    """How a batch becomes the model's arguments: `keys` name the batch's tensors (an image
    classifier's is always "pixel_values", as for transformers classifiers, so predict and serve
    feed it unchanged); `params` are the model's keyword names, or None to pass them in order."""

    keys: tuple[str, ...]
    params: tuple[str, ...] | None = None


def _example(inputs: Inputs, batch_size: int) -> Any:
    if inputs is None:
        return torch.zeros(batch_size, 3, 224, 224)
    if callable(inputs) and not torch.is_tensor(inputs):
        return inputs(batch_size)
    return inputs


def _image_shaped(example: Any) -> bool:
    return (
        torch.is_tensor(example) and example.dim() == 4 and example.shape[1] in (1, 3) and example.is_floating_point()
    )


def _as_named(example: Any) -> tuple[dict[str, torch.Tensor], Call]:
    if torch.is_tensor(example):
        return {"arg0": example}, Call(keys=("arg0",))
    if isinstance(example, (tuple, list)):
        named = {f"arg{i}": t for i, t in enumerate(example)}
        return named, Call(keys=tuple(named))
    if isinstance(example, dict):
        return dict(example), Call(keys=tuple(example), params=tuple(example))
    raise ValueError(f"example inputs are a {type(example).__name__}; pass a tensor, a tuple or a dict of tensors")


def _as_image_input(example: dict[str, torch.Tensor], call: Call) -> tuple[dict[str, torch.Tensor], Call]:
    """An image classifier's one input under the key "pixel_values"."""
    if not (len(example) == 1 and _image_shaped(next(iter(example.values())))):
        raise ValueError(
            "a custom image classifier takes one float tensor [B, C, H, W] with C = 1 or 3; "
            "give task='feature-extraction' for other inputs"
        )
    return {"pixel_values": next(iter(example.values()))}, Call(keys=("pixel_values",), params=call.params)


def _fit_rows(tensor: torch.Tensor, batch_size: int) -> torch.Tensor:
    """`tensor` repeated or cut along its first dimension to `batch_size` rows."""
    rows = tensor.shape[0]
    if rows == 0:
        raise ValueError("example inputs have an empty batch dimension; give at least one row")
    repeats = -(-batch_size // rows)
    return tensor.repeat(repeats, *([1] * (tensor.dim() - 1)))[:batch_size]


@dataclass(kw_only=True)
class CustomInputs:
    """The custom model's inputs: real photos (image classifiers) or seeded random rows shaped
    like the example. Stands where a tokenizer or image processor stands for transformers models."""

    task: str
    call: Call
    example: dict[str, torch.Tensor]
    make: Callable[[int], Any] | None = None  # the user's batch_size -> inputs, when given

    @classmethod
    def from_example(cls, inputs: Inputs, task: str) -> CustomInputs:
        example, call = _as_named(_example(inputs, 1))
        make = inputs if callable(inputs) and not torch.is_tensor(inputs) else None
        if task == "image-classification":
            example, call = _as_image_input(example, call)
        return cls(task=task, call=call, example=example, make=make)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        _, c, h, w = next(iter(self.example.values())).shape
        return c, h, w

    def batch(
        self, batch_size: int, *, image_size: int | None = None, synthetic: bool = False, offset: int = 0
    ) -> dict[str, torch.Tensor]:
        if self.task == "image-classification":
            from accelab.catalog import samples

            if synthetic:
                c, h, w = self.image_shape
                gen = torch.Generator().manual_seed(offset)
                side = (image_size, image_size) if image_size else (h, w)
                return {"pixel_values": torch.rand(batch_size, c, *side, generator=gen)}
            return self(images=samples.photos(batch_size, offset), size=image_size)
        if self.make is not None and not synthetic:
            named, _ = _as_named(self.make(batch_size))
            return dict(zip(self.call.keys, named.values()))
        return self.random_rows(batch_size, offset)

    def random_rows(self, batch_size: int, offset: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(1000 + offset)
        out = {}
        for name, tensor in self.example.items():
            shape = (batch_size, *tensor.shape[1:])
            if tensor.is_floating_point():
                scale = float(tensor.float().std()) if tensor.numel() > 1 and float(tensor.float().std()) > 0 else 1.0
                out[name] = (torch.randn(shape, generator=gen) * scale).to(tensor.dtype)
            elif tensor.dtype == torch.bool:
                out[name] = _fit_rows(tensor, batch_size)
            else:
                high = max(int(tensor.max()) + 1, 2)
                out[name] = torch.randint(0, high, shape, generator=gen, dtype=tensor.dtype)
        return out

    def __call__(
        self, images: Any, return_tensors: str = "pt", size: int | None = None, **_: Any
    ) -> dict[str, torch.Tensor]:
        """PIL images -> the model's image tensor, as an image processor would (so the photo paths
        of verify, predict and serve work unchanged)."""
        import numpy as np

        if not isinstance(images, (list, tuple)):
            images = [images]
        c, h, w = self.image_shape
        side = (size, size) if size else (h, w)
        mode = "L" if c == 1 else "RGB"
        arrays = [np.asarray(img.convert(mode).resize((side[1], side[0])), dtype=np.float32) / 255.0 for img in images]
        pixels = torch.from_numpy(np.stack(arrays))
        pixels = pixels.unsqueeze(1) if c == 1 else pixels.permute(0, 3, 1, 2)
        mean = torch.tensor(_IMAGENET_MEAN[:c] if c == 3 else (0.5,)).view(1, c, 1, 1)
        std = torch.tensor(_IMAGENET_STD[:c] if c == 3 else (0.5,)).view(1, c, 1, 1)
        return {"pixel_values": ((pixels - mean) / std).contiguous()}


# -- the model behind accelab's call shape --------------------------------------------------------
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
