"""The input pipeline: decoding and preprocessing in DataLoader workers, so the model never waits
for a JPEG decode or a tokenizer call.

    ItemDataset[i]  -> Example     decode one item (worker); a bad one carries its reason
    Collator(list)  -> Collated    the task's processor over the batch's good items (worker)
    DataLoader      -> Collated    pinned (CUDA) so the copy to the device can be non-blocking

The batches are given in advance (`batch_sampler`, the chunk plan's order), so the loader
yields them in exactly that order, whatever the number of workers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from accelab.predict.sources import BadItem, Source

log = logging.getLogger(__name__)

PREFETCH_BATCHES = 4  # per worker: enough to ride out a slow decode without holding many batches


@dataclass(frozen=True, slots=True)
class Example:
    index: int
    payload: Any  # an RGB PIL image or a str; None when `error`
    error: str | None = None


@dataclass(slots=True)
class Collated:
    """One batch: `tensors` rows are the items `indices`, in order; `skipped` the batch's bad items."""

    indices: list[int]
    tensors: dict[str, torch.Tensor]
    skipped: list[tuple[int, str]] = field(default_factory=list)

    def pin_memory(self) -> Collated:  # called by the DataLoader's pinning thread (pin_memory=True)
        self.tensors = {k: v.pin_memory() for k, v in self.tensors.items()}
        return self


class ItemDataset(Dataset):
    def __init__(self, source: Source):
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> Example:
        try:
            return Example(index, self.source.load(index))
        except BadItem as err:
            return Example(index, None, str(err))


class Collator:
    """Runs `encode` (the task's processor call) over a batch's good items. When the whole batch
    fails, each item is tried alone, so one input the processor rejects costs only itself."""

    def __init__(self, encode: Callable[[list[Any]], dict[str, torch.Tensor]]):
        self.encode = encode

    def __call__(self, examples: list[Example]) -> Collated:
        skipped = [(e.index, e.error) for e in examples if e.error is not None]
        good = [e for e in examples if e.error is None]
        try:
            return self._collate(good, skipped)
        except Exception:  # noqa: BLE001 - find out below which items the processor rejects
            pass
        usable = []
        for e in good:
            try:
                self.encode([e.payload])
                usable.append(e)
            except Exception as err:  # noqa: BLE001 - any error of the user's preprocessing skips that item alone
                skipped.append((e.index, f"preprocessing failed: {type(err).__name__}: {err}"))
        return self._collate(usable, skipped)  # items that pass alone but not together: a real bug, raised

    def _collate(self, good: list[Example], skipped: list[tuple[int, str]]) -> Collated:
        if not good:
            return Collated(indices=[], tensors={}, skipped=skipped)
        return Collated(
            indices=[e.index for e in good], tensors=self.encode([e.payload for e in good]), skipped=skipped
        )


def make_loader(
    source: Source,
    batches: list[list[int]],
    encode: Callable[[list[Any]], dict[str, torch.Tensor]],
    *,
    workers: int,
    pin_memory: bool,
) -> DataLoader:
    """A loader over `batches` (lists of item indices), in that order."""
    return DataLoader(
        ItemDataset(source),
        batch_sampler=batches,
        collate_fn=Collator(encode),
        num_workers=workers,
        pin_memory=pin_memory,
        prefetch_factor=PREFETCH_BATCHES if workers else None,
    )
