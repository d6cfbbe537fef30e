"""Images in the continuous steps of a vision-language model (Idefics3 / SmolVLM, LLaVA).

At arrival the processor runs once per request (`prepare_chat`): it expands each image into its
placeholder tokens and gives the pixel tensors. `split_images` cuts those into one `ImageInput`
per image: a content key (sha256 of the image's encoder inputs, so the same picture sent twice has
one key), the prompt positions its features fill, and the tensors the vision encoder takes for it
alone. Where the processor tiles images so that one image's share of the tensors cannot be told
apart (SmolVLM's image splitting with several images), the request's images go as one entry:
still correct, cached as a whole.

In the step engine the encoder runs when a prefill chunk first reaches an image's positions, and
its features stay in an `EncoderCache` under the image's key while a sequence holds them (and
after, least recently used first, up to a row budget), so a repeated image is encoded once. The
scheduler's prefix cache keys every block that holds image positions by the image's key too
(`cache_prompt`), so two images behind the same text never share KV blocks.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from accelab.serve.runner import packed_linear
from accelab.serve.runner.packed_linear import PackedLinears


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class ImageInput:
    key: str  # sha256 of the encoder inputs: equal pictures, equal keys
    positions: tuple[int, ...]  # prompt positions its feature rows fill, in row order
    inputs: dict[str, torch.Tensor]  # the vision encoder's inputs for this image alone

    @property
    def rows(self) -> int:
        """The feature rows the encoder gives for it."""
        return len(self.positions)


@dataclass(frozen=True, slots=True, eq=False)
class ImageBatch:
    """Images the vision encoder takes in one forward, their inputs joined along the image axis.
    A 2-core CPU runs a vision tower's GEMMs faster per image with more rows: SmolVLM-256M's
    tower in bf16 took 300 -> 255-270 ms an image at 2-4 images a forward, oneDNN's GEMMs of 768
    output columns running on one core at one image's 1024 rows and on both at 2048."""

    images: tuple[ImageInput, ...]
    inputs: dict[str, torch.Tensor]

    @property
    def key(self) -> str:
        return "+".join(image.key for image in self.images)

    @property
    def rows(self) -> int:
        return sum(image.rows for image in self.images)

    def split(self, features: torch.Tensor) -> list[torch.Tensor]:
        """Each image's rows of the features of the whole batch."""
        return list(features.split([image.rows for image in self.images]))


def batch_images(images: Sequence[ImageInput], size: int) -> list[ImageBatch]:
    """The images in order, in batches of up to `size` consecutive ones whose encoder inputs join
    (the same tensors, equal in every dimension but the image axis)."""
    batches: list[list[ImageInput]] = []
    for image in images:
        last = batches[-1] if batches else None
        if last is not None and len(last) < size and _joinable(last[0].inputs, image.inputs):
            last.append(image)
        else:
            batches.append([image])
    return [ImageBatch(images=tuple(batch), inputs=_joined([i.inputs for i in batch])) for batch in batches]


def _image_axis(inputs: dict[str, torch.Tensor]) -> int:
    """Where images stack: Idefics3's tensors are [1, tiles, ...] (its pixels 5-D), LLaVA's [images, ...]."""
    pixels = inputs.get("pixel_values")
    return 1 if pixels is not None and pixels.dim() == 5 else 0


def _joinable(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    if a.keys() != b.keys() or _image_axis(a) != _image_axis(b):
        return False
    axis = _image_axis(a)
    for name, x in a.items():
        y = b[name]
        if x.dtype != y.dtype or x.dim() != y.dim() or x.dim() <= axis:
            return False
        if x.shape[:axis] + x.shape[axis + 1 :] != y.shape[:axis] + y.shape[axis + 1 :]:
            return False
    return True


def _joined(parts: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    if len(parts) == 1:
        return parts[0]
    axis = _image_axis(parts[0])
    return {name: torch.cat([part[name] for part in parts], dim=axis) for name in parts[0]}


def image_token_id(config: Any) -> int:
    """The placeholder token that image features replace."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"{type(config).__name__} names no image token")


def split_images(model: Any, encoded: dict[str, Any], ids: Sequence[int], images: int) -> tuple[ImageInput, ...]:
    """One ImageInput per image of a processed prompt (`encoded`: the processor's output for one
    text; `ids`: its expanded token ids), or one for all of them where they cannot be split."""
    token = image_token_id(model.config)
    positions = [p for p, t in enumerate(ids) if t == token]
    if not images or not positions:
        return ()
    parts = _per_image(encoded, images)
    if parts is None or len(positions) % len(parts):
        parts = [_tensors(encoded)]
    rows = len(positions) // len(parts)
    return tuple(
        ImageInput(key=_key(part), positions=tuple(positions[i * rows : (i + 1) * rows]), inputs=part)
        for i, part in enumerate(parts)
    )


def _tensors(encoded: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {
        k: v for k, v in encoded.items() if isinstance(v, torch.Tensor) and k not in ("input_ids", "attention_mask")
    }


def _per_image(encoded: dict[str, Any], images: int) -> list[dict[str, torch.Tensor]] | None:
    """Each image's slice of the pixel tensors: LLaVA's are [images, C, H, W]; Idefics3's are
    [1, tiles, C, H, W] (and its mask [1, tiles, H, W]), one tile per image without splitting."""
    tensors = _tensors(encoded)
    pixels = tensors.get("pixel_values")
    if pixels is None:
        return None
    if pixels.dim() == 4 and pixels.shape[0] == images:
        return [{k: v[i : i + 1] for k, v in tensors.items()} for i in range(images)]
    if pixels.dim() == 5 and pixels.shape[0] == 1 and pixels.shape[1] == images:
        return [{k: v[:, i : i + 1] for k, v in tensors.items()} for i in range(images)]
    return None


def _key(inputs: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(inputs):
        value = inputs[name].detach().contiguous().cpu()
        digest.update(f"{name}:{value.dtype}:{tuple(value.shape)};".encode())
        digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def cache_prompt(ids: Sequence[int], images: Sequence[ImageInput]) -> tuple[Hashable, ...]:
    """The prompt as the prefix cache sees it: each image position is (image key, row), so blocks
    holding different images never match, and equal images behind equal text do."""
    keyed: list[Hashable] = list(ids)
    for image in images:
        for row, position in enumerate(image.positions):
            keyed[position] = (image.key, row)
    return tuple(keyed)


def prompt_keys(prompt: Any) -> tuple[Hashable, ...] | None:
    """A Prompt with images as the prefix cache keys it (None: its token ids say it all)."""
    return cache_prompt(prompt.ids, prompt.media) if prompt.media else None


def vision_parts(model: Any) -> tuple[Any, Any] | None:
    """(the language model's decoder, its output layer) of a vision-language model, or None."""
    inner = getattr(model, "model", None)
    for name in ("text_model", "language_model"):
        decoder = getattr(inner, name, None)
        if decoder is not None and hasattr(decoder, "layers"):
            return decoder, model.get_output_embeddings()
    return None


class VisionEncoder:
    """The model's own vision tower and projector: features [rows, hidden] of one ImageInput.
    Their Linear layers run on oneDNN from packed weights, a ViT MLP's GELU inside its first
    GEMM (`packed_linear.PackedLinears`, where the CPU has it; `reference` suspends it)."""

    def __init__(self, model: Any, device: torch.device, dtype: torch.dtype, *, pack: bool = True):
        owner = model if hasattr(model, "get_image_features") else model.model
        self._encode = owner.get_image_features
        self.device, self.dtype = device, dtype
        inner = getattr(model, "model", model)  # where transformers keeps the vision tower and projector
        self.layers = encoder_layers(inner)
        parts = [getattr(inner, n) for n in _VISION_PARTS if isinstance(getattr(inner, n, None), torch.nn.Module)]
        self._packed = (
            PackedLinears(torch.nn.ModuleList(parts), batch_hint=_PATCH_ROWS, vit=True)
            if pack and parts and packed_linear.available(device, dtype)
            else None
        )

    def reference(self) -> contextlib.AbstractContextManager[None]:
        """The model's own layers meanwhile (what the start-up check compares with)."""
        return self._packed.suspended() if self._packed is not None else contextlib.nullcontext()

    def close(self) -> None:
        if self._packed is not None:
            self._packed.unpack()
            self._packed = None

    def __call__(self, image: ImageInput | ImageBatch) -> torch.Tensor:
        """Feature rows of one image, or of a batch's images one after the other."""
        inputs = {k: v.to(self.device) for k, v in image.inputs.items()}
        out = self._encode(**inputs)
        features = getattr(out, "pooler_output", out)
        if isinstance(features, (list, tuple)):
            features = torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
        features = features.reshape(-1, features.shape[-1]).to(self.dtype)
        if features.shape[0] != image.rows:
            raise ValueError(
                f"the vision encoder gave {features.shape[0]} feature rows for images the processor gave "
                f"{image.rows} placeholder tokens"
            )
        return features


def encoder_layers(owner: Any) -> torch.nn.ModuleList | None:
    """The vision tower's transformer layers (its longest ModuleList), or None."""
    tower = next((getattr(owner, n) for n in ("vision_model", "vision_tower") if hasattr(owner, n)), None)
    lists = [m for m in tower.modules() if isinstance(m, torch.nn.ModuleList)] if tower is not None else []
    return max(lists, key=len, default=None)


_VISION_PARTS = ("vision_model", "vision_tower", "connector", "multi_modal_projector")
_PATCH_ROWS = 1024  # the rows a vision tower's GEMMs take: one 512 px tile of 16 px patches


@dataclass(frozen=True, kw_only=True, slots=True)
class ImageCounts:
    """The image work of the steps since the last report (the server's /metrics)."""

    encoded: int  # images the vision encoder ran on
    hits: int  # images a sequence took from the encoder cache instead
    seconds: float  # encoder time


@dataclass(kw_only=True, slots=True)
class EncoderCache:
    """Image features by image key. An entry a sequence holds stays; the others go least recently
    used first once more than `max_rows` rows are kept. Counts hits, misses and encoder time."""

    max_rows: int
    hits: int = 0
    misses: int = 0
    encode_s: float = 0.0
    _features: OrderedDict[str, torch.Tensor] = field(default_factory=OrderedDict)
    _holders: dict[str, set[int]] = field(default_factory=dict)  # key -> the sequences that hold it
    _held: dict[int, set[str]] = field(default_factory=dict)  # sequence -> the keys it holds
    _reported: ImageCounts = field(default_factory=lambda: ImageCounts(encoded=0, hits=0, seconds=0.0))

    def get(self, seq_id: int, image: ImageInput, encode: Any) -> torch.Tensor:
        features = self._features.get(image.key)
        if features is None:
            started = time.perf_counter()
            features = encode(image)
            self.encode_s += time.perf_counter() - started
            self.misses += 1
            self._features[image.key] = features
        elif image.key not in self._held.get(seq_id, ()):
            self.hits += 1
        self._features.move_to_end(image.key)
        self._holders.setdefault(image.key, set()).add(seq_id)
        self._held.setdefault(seq_id, set()).add(image.key)
        self._evict()
        return features

    def add(self, key: str, features: torch.Tensor, holders: Sequence[int], seconds: float) -> None:
        """Features encoded outside a step (`encoder_slices`), held by the sequences waiting for
        them: one encoding, and a hit for each sequence after the first."""
        self.misses += 1
        self.hits += max(0, len(set(holders)) - 1)
        self.encode_s += seconds
        self._features[key] = features
        for seq_id in holders:
            self._holders.setdefault(key, set()).add(seq_id)
            self._held.setdefault(seq_id, set()).add(key)
        self._evict()

    def __contains__(self, key: object) -> bool:
        return key in self._features

    def release(self, seq_id: int) -> None:
        for key in self._held.pop(seq_id, ()):
            holders = self._holders.get(key)
            if holders is not None:
                holders.discard(seq_id)
                if not holders:
                    del self._holders[key]
        self._evict()

    def take_counts(self) -> ImageCounts | None:
        """What happened since the last call (None: nothing)."""
        now = ImageCounts(encoded=self.misses, hits=self.hits, seconds=self.encode_s)
        last, self._reported = self._reported, now
        if now == last:
            return None
        return ImageCounts(
            encoded=now.encoded - last.encoded, hits=now.hits - last.hits, seconds=now.seconds - last.seconds
        )

    @property
    def rows(self) -> int:
        return sum(f.shape[0] for f in self._features.values())

    def __len__(self) -> int:
        return len(self._features)

    def _evict(self) -> None:
        excess = self.rows - self.max_rows
        for key in list(self._features):
            if excess <= 0:
                return
            if key not in self._holders:
                excess -= self._features.pop(key).shape[0]


def image_rows(inputs: Sequence[Any]) -> list[tuple[int, int, ImageInput, int]]:
    """(packed row, sequence, image, feature row) for every image position the step's chunks
    feed, with the chunks packed in order (`inputs`: StepInputs)."""
    placed: list[tuple[int, int, ImageInput, int]] = []
    offset = 0
    for item in inputs:
        end = item.start + len(item.tokens)
        for image in item.images:
            for row, position in enumerate(image.positions):
                if item.start <= position < end:
                    placed.append((offset + position - item.start, item.seq_id, image, row))
        offset += len(item.tokens)
    return placed


def image_inserts(
    inputs: Sequence[Any], cache: EncoderCache, encoder: VisionEncoder, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(packed rows, their image features) for the image positions this step feeds; each image
    encoded at the first step that reaches it, then taken from the encoder cache."""
    placed = image_rows(inputs)
    if not placed:
        return None
    features = {(seq, image.key): cache.get(seq, image, encoder) for _, seq, image, _ in placed}
    rows = torch.tensor([row for row, _, _, _ in placed], dtype=torch.long, device=device)
    values = torch.stack([features[seq, image.key][r] for _, seq, image, r in placed])
    return rows, values
