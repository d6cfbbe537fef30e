"""Real sample inputs, offline: texts written for this project (in `data/`) and Python's own
language reference (the quality guard's evaluation text), real photos from scikit-learn and
scikit-image, and scikit-learn's labelled 8x8 digits.

Every function is deterministic: the same call gives the same items on every machine.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from pydoc_data.topics import topics  # ~5 ms: the language reference's text, in every CPython
from typing import Literal, TypeVar

import numpy as np
from PIL import Image, ImageOps

log = logging.getLogger(__name__)

DATA = Path(__file__).parent / "data"
SEED = 0
T = TypeVar("T")

# Colour photographs first, then greyscale ones (converted to RGB).
SKIMAGE_PHOTOS = (
    "astronaut",
    "coffee",
    "chelsea",
    "rocket",
    "hubble_deep_field",
    "camera",
    "coins",
    "moon",
    "clock",
    "brick",
    "grass",
    "gravel",
)
Split = Literal["train", "test", "all"]


def cycle(items: Sequence[T], n: int, offset: int = 0) -> list[T]:
    """n items starting at `offset`, wrapping around: the building block of every batch."""
    if not items:
        raise ValueError("no items to cycle through")
    return [items[(offset + i) % len(items)] for i in range(n)]


# Texts


@functools.cache
def _json_list(name: str) -> tuple[str, ...]:
    return tuple(json.loads((DATA / name).read_text()))


@functools.cache
def _sentences() -> tuple[str, ...]:
    lines = (DATA / "sentences.txt").read_text().splitlines()
    return tuple(line.strip() for line in lines if line.strip())


def prompts(n: int, offset: int = 0) -> list[str]:
    """Chat prompts of varied length (geography, code, cooking, science, ...); cycles past 52."""
    return cycle(_json_list("prompts.json"), n, offset)


def image_prompts(n: int, offset: int = 0) -> list[str]:
    """Short questions about a photo, for vision-language models."""
    return cycle(_json_list("image_prompts.json"), n, offset)


def sentences(n: int, offset: int = 0) -> list[str]:
    """Single sentences on everyday topics (224 of them, with paraphrase pairs), for embeddings."""
    return cycle(_sentences(), n, offset)


@functools.cache
def heldout_text() -> str:
    """An essay of ~3,700 words on the history of computing (perplexity, small LM fine-tuning)."""
    return (DATA / "heldout.txt").read_text()


@functools.cache
def evaluation_text() -> str:
    """The text the quality guard scores teacher-forced (~64k SmolLM2 tokens): the held-out essay,
    then the prose of Python's own language reference as every CPython ships it
    (`pydoc_data.topics`, the text of `help()`), its topics in sorted order.

    Why this text: it is real English written by people, it installs with Python (no download,
    no data file to license), and it is long enough for a few hundred windows of 128 tokens,
    where the 5k tokens of the essay alone give forty. Indented lines (code examples, grammar
    rules) and the heading underlines are dropped: what is scored is prose. The topics change a
    little between Python releases; `evaluation_digest` names the text a reference was made on."""
    parts = [heldout_text().strip()]
    for name in sorted(topics):
        lines = [line for line in topics[name].splitlines() if _prose(line)]
        parts.append("\n".join(lines).strip())
    return "\n\n".join(part for part in parts if part)


def _prose(line: str) -> bool:
    return bool(line.strip()) and not line.startswith((" ", "\t")) and not set(line.strip()) <= set("*=-~^")


def evaluation_digest() -> str:
    """A short digest of `evaluation_text`: references cached on another text are not reused."""
    return hashlib.sha256(evaluation_text().encode()).hexdigest()[:16]


# Photos


@functools.cache
def _real_photos() -> tuple[Image.Image, ...]:
    from sklearn.datasets import load_sample_images

    arrays = list(load_sample_images().images)  # china, flower
    for name in SKIMAGE_PHOTOS:
        try:
            import skimage.data

            arrays.append(getattr(skimage.data, name)())
        except Exception as err:  # noqa: BLE001 - some scikit-image versions fetch a few images on demand (any error)
            log.info("skipping skimage.data.%s: %s", name, err)
    return tuple(Image.fromarray(np.asarray(a)).convert("RGB") for a in arrays)


def photos(n: int, offset: int = 0) -> list[Image.Image]:
    """n real RGB photos (14 distinct ones). Beyond those, copies get a deterministic random crop
    and a horizontal flip every other round, so that no two images in a batch are identical."""
    base = _real_photos()
    return [_variant(base, offset + i) for i in range(n)]


def _variant(base: Sequence[Image.Image], index: int) -> Image.Image:
    image = base[index % len(base)]
    round_ = index // len(base)
    if round_ == 0:
        return image.copy()
    rng = np.random.default_rng([SEED, index])
    w, h = image.size
    scale = rng.uniform(0.6, 0.9)
    cw, ch = int(w * scale), int(h * scale)
    left, top = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    crop = image.crop((left, top, left + cw, top + ch))
    return ImageOps.mirror(crop) if round_ % 2 == 1 else crop


# Digits


@functools.cache
def _digits_split() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    images = (data.images * (255.0 / 16.0)).round().astype(np.uint8)  # values 0..16 -> 0..255
    x_train, x_test, y_train, y_test = train_test_split(
        images, data.target, test_size=0.2, random_state=SEED, stratify=data.target
    )
    return {"train": (x_train, y_train), "test": (x_test, y_test), "all": (images, data.target)}


def digits(split: Split = "all", image_size: int = 32) -> tuple[list[Image.Image], list[int]]:
    """scikit-learn's handwritten digits (1,797 8x8 images, labels 0-9) as RGB PIL images
    upscaled to image_size; split "train" (80 %) / "test" (20 %) is stratified with seed 0."""
    splits = _digits_split()
    if split not in splits:
        raise ValueError(f"split={split!r} is not one of {', '.join(splits)}")
    if image_size < 8:
        raise ValueError(f"image_size={image_size} is too small: the digits are 8x8, pass 8 or more")
    arrays, labels = splits[split]
    images = [
        Image.fromarray(a).resize((image_size, image_size), Image.Resampling.BILINEAR).convert("RGB") for a in arrays
    ]
    return images, [int(y) for y in labels]
