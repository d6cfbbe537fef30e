"""Decoding attention over the paged KV cache in place: one query a sequence, a small C++ kernel.

A decoding step's attention is tiny arithmetic (8 sequences of 160 positions: ~1 MB of keys and
values a layer) but, written as tensor operations, it first gathers each sequence's blocks into
a copy, converts and transposes it for two matmuls; compiled by inductor that took 97-145 us a
layer of SmolLM2 at 8 sequences (a third of the step at 16), and fusing the gather into the
reductions was slower still (the fused kernel ran 201 us). This kernel reads each key and value
where it lies in its block, once for all the query heads that share it (grouped-query
attention), in float32: per (sequence, kv head), the scores, their softmax and the weighted sum
of the values, the pairs spread over torch's threads.

`accelab::decode_attention(q [B, hq, d], k_cache, v_cache [blocks, block_size, kv_heads, d],
tables [B, N], positions [B], scale, window) -> [B, hq, d] float32`: the query of sequence b sits
at positions[b] and sees keys at positions max(0, positions[b] - window + 1) .. positions[b]
(window 0: all), found through its block table. float32 and bfloat16 caches.

Built once per machine (`kernels`: `make install` builds it, else the first server that needs it
does); `available()` says whether it loaded, and why not.
"""

from __future__ import annotations

import torch

from accelab.ops import loader

NAME = "accelab_decode_attention"


DTYPES = (torch.float32, torch.bfloat16)
HEAD_DIMS = (8, 16, 32, 64, 80, 96, 128, 256)  # the kernel's unrolled sizes


def _shape(q, k_cache, v_cache, tables, positions, scale, window):
    return q.new_empty(q.shape, dtype=torch.float32)


LIBRARY = loader.Library(NAME, "decode_attention.cpp", "decode_attention", _shape)


def available(dtype: torch.dtype, head_dim: int) -> str | None:
    """None when the kernel runs caches of `dtype` and `head_dim` here, else why not."""
    if dtype not in DTYPES:
        return f"it takes float32 and bfloat16 caches, not {dtype}"
    if head_dim not in HEAD_DIMS:
        return f"it takes head sizes {', '.join(map(str, HEAD_DIMS))}, not {head_dim}"
    return LIBRARY.ready()


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tables: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """q [B, hq, d] at `positions` [B] over the cache blocks of `tables` [B, N] -> [B, hq, d] float32."""
    return torch.ops.accelab.decode_attention(q, keys, values, tables, positions, scale, window or 0)
