"""Model-ready batches built from the real sample inputs (or random ones of the same shape).

forward_batch: one forward pass. Text is padded on the right to exactly seq_len ([B, seq_len]);
images go through the model's image processor ([B, 3, H, W]); VLM inputs are image + question
through the processor's chat template, padded on the right to exactly seq_len.
generate_batch: prompts through the chat template, padded on the LEFT (generate continues
from the last column, so real tokens must end there).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

from accelab.catalog import samples
from accelab.catalog.facts import GENERATE_TASKS, max_sequence_length
from accelab.catalog.load import Loaded

log = logging.getLogger(__name__)

Batch = dict[str, torch.Tensor]


def forward_batch(
    loaded: Loaded,
    batch_size: int,
    *,
    seq_len: int = 128,
    image_size: int | None = None,
    synthetic: bool = False,
    offset: int = 0,
) -> Batch:
    """A batch for `loaded.model(**batch)`; `offset` shifts which samples are used (cycling)."""
    _check_batch_size(batch_size)
    task = loaded.spec.task
    if loaded.spec.custom:  # its own inputs (see catalog.custom.CustomInputs)
        return loaded.processor.batch(batch_size, image_size=image_size, synthetic=synthetic, offset=offset)
    if task in ("text-generation", "feature-extraction"):
        batch = _text_forward(loaded, batch_size, seq_len, offset)
    elif task == "image-classification":
        batch = _image_forward(loaded, batch_size, image_size, offset)
    else:
        batch = _vlm_forward(loaded, batch_size, seq_len, image_size, offset)
    return _randomised(loaded, batch, offset) if synthetic else batch


def generate_batch(loaded: Loaded, batch_size: int, *, offset: int = 0, synthetic: bool = False) -> Batch:
    """Chat prompts (text) or photo + question (VLM) with the generation prompt, left padded."""
    _check_batch_size(batch_size)
    task = loaded.spec.task
    if task not in GENERATE_TASKS:
        raise ValueError(
            f"generate needs a text-generation or image-text-to-text model; {loaded.spec.name} is {task} "
            "(use the forward scenario)"
        )
    if task == "text-generation":
        batch = _text_generate(loaded.processor, batch_size, offset)
    else:
        batch = _vlm_inputs(loaded.processor, batch_size, offset, padding_side="left")
    return _randomised(loaded, batch, offset) if synthetic else batch


def _check_batch_size(batch_size: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} is out of range: it must be 1 or more")


# Text


def check_seq_len(loaded: Loaded, seq_len: int) -> None:
    limit = max_sequence_length(loaded.model)
    if seq_len < 1 or (limit is not None and seq_len > limit):
        raise ValueError(
            f"seq_len={seq_len} is out of range for {loaded.spec.name}: it accepts 1 to {limit} tokens "
            f"(max_position_embeddings); pass --seq-len {limit} or less"
        )


def _text_forward(loaded: Loaded, batch_size: int, seq_len: int, offset: int) -> Batch:
    check_seq_len(loaded, seq_len)
    tokenizer = loaded.processor
    texts = samples.sentences(batch_size, offset)
    encoded = tokenizer(
        texts, padding="max_length", truncation=True, max_length=seq_len, padding_side="right", return_tensors="pt"
    )
    return dict(encoded)  # input_ids / attention_mask (/ token_type_ids): [B, seq_len]


def _text_generate(tokenizer: Any, batch_size: int, offset: int) -> Batch:
    questions = samples.prompts(batch_size, offset)
    if tokenizer.chat_template:
        texts = [
            tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
            for q in questions
        ]
        special = False  # the template already holds the special tokens
    else:
        texts, special = questions, True
    encoded = tokenizer(texts, padding=True, padding_side="left", add_special_tokens=special, return_tensors="pt")
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}


# Images


def _image_forward(loaded: Loaded, batch_size: int, image_size: int | None, offset: int) -> Batch:
    processor = loaded.processor
    kwargs = {}
    if image_size is not None:
        _check_image_size(loaded, image_size)
        kwargs = _size_override(processor, image_size)
    pixels = processor(images=samples.photos(batch_size, offset), return_tensors="pt", **kwargs)
    return {"pixel_values": pixels["pixel_values"]}  # [B, 3, H, W]


def _size_override(processor: Any, image_size: int) -> dict:
    """Processor kwargs that make its output image_size x image_size."""
    size = dict(getattr(processor, "size", None) or {})
    kwargs: dict[str, Any] = {}
    if "height" in size:
        kwargs["size"] = {"height": image_size, "width": image_size}
    elif "shortest_edge" in size:  # resize the short side, then centre-crop a square
        kwargs["size"] = {"shortest_edge": image_size}
    elif "longest_edge" in size:
        kwargs["size"] = {"longest_edge": image_size}
    if getattr(processor, "crop_size", None):
        kwargs["crop_size"] = {"height": image_size, "width": image_size}
    return kwargs


def _check_image_size(loaded: Loaded, image_size: int) -> None:
    # ViT-like models have position embeddings for one image size; they need
    # interpolate_pos_encoding=True for another size, which a plain model(**batch) does not pass.
    config = loaded.model.config
    native = getattr(config, "image_size", None)
    takes_interp = "interpolate_pos_encoding" in inspect.signature(loaded.model.forward).parameters
    if takes_interp and native is not None and image_size != native:
        raise ValueError(
            f"image_size={image_size} does not fit {loaded.spec.name}: its position embeddings are for "
            f"{native} px images; omit --image-size (or pass {native}), or use a convolutional model "
            "(resnet-50, convnext-tiny) to vary the image size"
        )


# Vision-language


def _vlm_forward(loaded: Loaded, batch_size: int, seq_len: int, image_size: int | None, offset: int) -> Batch:
    if image_size is not None:
        raise ValueError(
            f"image_size={image_size} is not supported for {loaded.spec.name} "
            "(its vision tower has a fixed size); omit --image-size"
        )
    check_seq_len(loaded, seq_len)
    batch = _vlm_inputs(loaded.processor, batch_size, offset, padding_side="right")
    length = batch["input_ids"].shape[1]
    if length > seq_len:  # truncating would cut image tokens
        raise ValueError(
            f"seq_len={seq_len} is too short for {loaded.spec.name}: its image and question take {length} "
            f"tokens; pass --seq-len {length} or more"
        )
    return _pad_right(batch, seq_len, loaded.processor.tokenizer.pad_token_id)


def _vlm_inputs(processor: Any, batch_size: int, offset: int, *, padding_side: str) -> Batch:
    images = samples.photos(batch_size, offset)
    texts = [
        processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for q in samples.image_prompts(batch_size, offset)
    ]
    encoded = processor(images=images, text=texts, padding=True, padding_side=padding_side, return_tensors="pt")
    return {k: v for k, v in encoded.items() if isinstance(v, torch.Tensor)}


def _pad_right(batch: Batch, seq_len: int, pad_id: int) -> Batch:
    extra = seq_len - batch["input_ids"].shape[1]
    if extra == 0:
        return batch
    out = dict(batch)
    out["input_ids"] = torch.nn.functional.pad(batch["input_ids"], (0, extra), value=pad_id)
    for key in ("attention_mask", "token_type_ids", "mm_token_type_ids"):
        if key in batch:
            out[key] = torch.nn.functional.pad(batch[key], (0, extra), value=0)
    return out


# Synthetic


def _randomised(loaded: Loaded, batch: Batch, offset: int) -> Batch:
    """Same shapes and masks, random content: pixels ~ N(0, 1), token ids uniform over the
    vocabulary except special tokens (image placeholders and padding stay where they are)."""
    gen = torch.Generator().manual_seed(offset)
    out = dict(batch)
    for key in ("pixel_values",):
        if key in batch:
            out[key] = torch.randn(batch[key].shape, generator=gen, dtype=batch[key].dtype)
    if "input_ids" in batch:
        out["input_ids"] = _random_ids(loaded, batch, gen)
    return out


def _random_ids(loaded: Loaded, batch: Batch, gen: torch.Generator) -> torch.Tensor:
    tokenizer = getattr(loaded.processor, "tokenizer", loaded.processor)
    ids = batch["input_ids"]
    vocab = tokenizer.vocab_size  # the base vocabulary, without added special tokens
    special = torch.tensor(sorted(set(tokenizer.all_special_ids)), dtype=ids.dtype)
    keep = torch.isin(ids, special)
    if "attention_mask" in batch:
        keep |= batch["attention_mask"] == 0
    random = torch.randint(0, vocab, ids.shape, generator=gen, dtype=ids.dtype)
    random = torch.where(torch.isin(random, special), ids, random)
    return torch.where(keep, ids, random)
