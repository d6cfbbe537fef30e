"""The paged KV cache: one preallocated tensor of blocks per layer for keys and one for values,
indexed by the block ids of the scheduler's `BlockPool` (`accelab.serve.kv_blocks`). What the
pool counts is what this holds: `kv_blocks x block_size` positions, allocated once at start-up.

Layout, per layer: [num_blocks, block_size, kv_heads, head_dim]. Position p of a sequence with
block table `table` is slot `table[p // block_size] * block_size + p % block_size` of the flat
view [num_blocks * block_size, kv_heads, head_dim]: new keys and values are written there with
one `index_copy_` per layer, and attention gathers a sequence's blocks with one index.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)


class PagedKVCache:
    def __init__(
        self,
        *,
        layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        announce: bool = True,
    ):
        self.layers, self.num_blocks, self.block_size = layers, num_blocks, block_size
        self.kv_heads, self.head_dim = kv_heads, head_dim
        shape = (num_blocks, block_size, kv_heads, head_dim)
        # zeros, not empty: a padded gather reads slots no sequence wrote (masked, but never NaN)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        if announce:  # the pool a server sizes, not a scratch cache
            log.info(
                "paged KV cache: %d layers x %d blocks of %d positions (%.1f MB)",
                layers,
                num_blocks,
                block_size,
                self.nbytes / 1e6,
            )

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    @property
    def bytes_per_block(self) -> int:
        return self.nbytes // self.num_blocks

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """slots: [T] flat positions; keys, values: [T, kv_heads, head_dim]."""
        if keys.shape[1:] != (self.kv_heads, self.head_dim) or values.shape[1:] != keys.shape[1:]:
            raise ValueError(
                f"the model caches keys of {tuple(keys.shape[1:])} and values of "
                f"{tuple(values.shape[1:])} per token; the paged cache holds ({self.kv_heads}, "
                f"{self.head_dim}) (the config's "
                "num_key_value_heads x head_dim): this attention caches something else (latent attention?)"
            )
        self.keys[layer].view(-1, self.kv_heads, self.head_dim).index_copy_(0, slots, keys)
        self.values[layer].view(-1, self.kv_heads, self.head_dim).index_copy_(0, slots, values)

    def gather(self, layer: int, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tables: [B, max_blocks] block ids -> keys, values [B, kv_heads, max_blocks * block_size, head_dim]."""
        b, n = tables.shape
        flat = tables.reshape(-1)  # index_select copies whole blocks: 3x faster here than tensor[tables]
        keys = self.keys[layer].index_select(0, flat).view(b, n * self.block_size, self.kv_heads, self.head_dim)
        values = self.values[layer].index_select(0, flat).view(b, n * self.block_size, self.kv_heads, self.head_dim)
        return keys.transpose(1, 2), values.transpose(1, 2)

    def copy_blocks(self, pairs: Sequence[Any]) -> None:
        """Copy-on-write: every layer's block `src` into block `dst`, for each (src, dst)."""
        if not pairs:
            return
        src = torch.tensor([p.src for p in pairs], dtype=torch.long, device=self.keys[0].device)
        dst = torch.tensor([p.dst for p in pairs], dtype=torch.long, device=self.keys[0].device)
        for tensor in (*self.keys, *self.values):
            tensor.index_copy_(0, dst, tensor.index_select(0, src))
