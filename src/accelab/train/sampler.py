"""The training data order: one seeded permutation per epoch, the same in every process.

Why our own sampler: the order must depend on (seed, epoch) only, so that
- 1 process and N processes see the same samples per optimizer step: every rank draws the same
  permutation and accelerate (`split_batches=True`) gives rank r the r-th slice of each batch;
- a resumed run re-creates the epoch's order and skips the batches already seen;
- every epoch has a whole number of optimizer steps: the permutation is cut to a multiple of
  the global batch, so no step sees a partial accumulation (a different sample subset is left
  out each epoch).
It deliberately has no `generator` attribute: accelerate would then try to synchronise it
across processes, which a (seed, epoch) order does not need.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class EpochSampler(Sampler[int]):
    def __init__(self, num_samples: int, *, seed: int, multiple_of: int, shuffle: bool = True):
        if multiple_of < 1:
            raise ValueError(f"multiple_of={multiple_of} must be 1 or more")
        if num_samples < multiple_of:
            raise ValueError(
                f"the training set has {num_samples} samples, fewer than one global batch ({multiple_of}); "
                "lower --batch-size or use more data"
            )
        self.num_samples = num_samples
        self.seed = seed
        self.multiple_of = multiple_of
        self.shuffle = shuffle
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples - self.num_samples % self.multiple_of

    def order(self) -> list[int]:
        if not self.shuffle:
            return list(range(len(self)))
        rng = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.num_samples, generator=rng)[: len(self)].tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.order())
