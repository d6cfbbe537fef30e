"""A custom model's inputs, in place of a tokenizer or image processor: the example call the user
gave (a tensor, a tuple, a dict, or a callable batch_size -> one of those) named as a batch, and
batches of any size made from it:
- image-classification (inputs [B, C, H, W], C = 1 or 3): the real sample photos, resized to
  H x W and normalised with the ImageNet mean and std; synthetic inputs are random images;
- feature-extraction (any other inputs): the example inputs' shapes and dtypes filled with
  seeded random values, a different row per sample (integer inputs stay below their maximum + 1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

_IMAGENET_MEAN = (0.485, 0.456, 0.406)
_IMAGENET_STD = (0.229, 0.224, 0.225)
Inputs = Any  # a tensor (the first positional argument), a tuple of tensors, a dict of named tensors,
# or a callable batch_size -> one of those


@dataclass(frozen=True, kw_only=True, slots=True)
class Call:
    """How a batch becomes the model's arguments: `keys` name the batch's tensors (an image
    classifier's is always "pixel_values", as for transformers classifiers, so predict and serve
    feed it unchanged); `params` are the model's keyword names, or None to pass them in order."""

    keys: tuple[str, ...]
    params: tuple[str, ...] | None = None


def example_of(inputs: Inputs, batch_size: int) -> Any:
    if inputs is None:
        return torch.zeros(batch_size, 3, 224, 224)
    if callable(inputs) and not torch.is_tensor(inputs):
        return inputs(batch_size)
    return inputs


def image_shaped(example: Any) -> bool:
    return (
        torch.is_tensor(example) and example.dim() == 4 and example.shape[1] in (1, 3) and example.is_floating_point()
    )


def as_named(example: Any) -> tuple[dict[str, torch.Tensor], Call]:
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
    if not (len(example) == 1 and image_shaped(next(iter(example.values())))):
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
        example, call = as_named(example_of(inputs, 1))
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
            named, _ = as_named(self.make(batch_size))
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
