"""Attention of one continuous-batching step over the paged KV cache, for every sequence at once.

The step's chunks (one token per decoding sequence, prefill chunks of new ones) are packed into
ONE sequence of T tokens for the model's own forward. Each layer:
1. `_StepCache.update` writes the T new keys and values into their slots of the block pool (one
   `index_copy_` for keys, one for values);
2. `paged_attention` (registered with transformers' `AttentionInterface`) gathers each
   sequence's blocks, by its block table, into [B, kv_heads, L, head_dim] and runs ONE
   `scaled_dot_product_attention` for all the decoding sequences (one query each) and one for
   all the prefilling chunks (their queries padded to the longest chunk), each with a mask of
   the positions each query may see (causal; sliding windows, logit soft-capping and attention
   sinks where the layer asks for them). On the CPU, a group of decoding sequences (one query
   each) runs the C++ kernel of `decode_attention` instead, which reads the blocks in place
   (no soft-capping or sinks there).

The metadata (slots, padded tables, masks) is built once per step by `StepLayout` and shared
by every layer; masks per sliding-window size are built on first use.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from accelab.ops.decode_attention import available as decode_attention_missing, decode_attention
from accelab.serve.runner.kv_cache import PagedKVCache

ATTENTION_NAME = "accelab_paged"
# Below this many query x key positions (rows x keys x queries per row), bf16 / fp16 attention runs
# as fp32 SDPA on converted copies: measured for SmolLM2's heads, fp32 SDPA took 0.05-0.10 ms up to
# 2 x 256 and 1 x 1024 positions where the grouped bf16 GEMMs took 0.13-0.19 ms, and fell behind
# from 8 x 128 (0.18 against 0.20 ms; 4 x 512: 1.3 against 0.25 ms).
SMALL_ATTENTION = 1024


@dataclass(slots=True)
class _Group:
    """Sequences attended in one call: B rows of Q queries (padded), keys up to L positions."""

    rows: torch.Tensor  # [B, Q] index of each query in the step's T tokens (padding repeats a real one)
    q_pos: torch.Tensor  # [B, Q] each query's position in its sequence (padding: 0)
    tables: torch.Tensor  # [B, max_blocks] block ids (padding: block 0, masked)
    keep: torch.Tensor | None  # [n] flat indices of the real queries in [B * Q]; None: all are real
    targets: torch.Tensor  # [n] their index in T
    span: tuple[int, int] | None = None  # (first, end): rows are tokens first..end-1 in order, no padding
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # window -> [B, 1, Q, L] bool

    def mask(self, window: int | None, length: int) -> torch.Tensor:
        mask = self.masks.get(window)
        if mask is None:
            kv = torch.arange(length, device=self.q_pos.device)
            pos = self.q_pos[:, :, None]
            mask = kv <= pos  # causal: position j is seen by queries at positions >= j
            if window:
                mask &= kv > pos - window  # the last `window` positions, the query's own included
            mask = self.masks[window] = mask[:, None]
        return mask


class StepLayout:
    """Where the step's T tokens go in the cache, and how they are grouped for attention."""

    def __init__(self, inputs: Sequence[Any], block_size: int, device: torch.device):
        slots: list[int] = []
        positions: list[int] = []
        self.ids: list[int] = []  # the step's T tokens, packed
        self.sampled: list[int] = []  # the index in T of each sampling input's last token
        decodes: list[tuple[int, Any]] = []  # (offset in T, input)
        prefills: list[tuple[int, Any]] = []
        offset = 0
        for item in inputs:
            n, table = len(item.tokens), item.blocks
            if len(table) * block_size < item.start + n:
                raise ValueError(
                    f"sequence {item.seq_id}: {len(table)} blocks of {block_size} hold "
                    f"{len(table) * block_size} positions; the chunk ends at {item.start + n}"
                )
            for p in range(item.start, item.start + n):
                slots.append(table[p // block_size] * block_size + p % block_size)
            positions.extend(range(item.start, item.start + n))
            self.ids.extend(item.tokens)
            if item.sample:
                self.sampled.append(offset + n - 1)
            (decodes if n == 1 else prefills).append((offset, item))
            offset += n
        self.tokens = offset
        self.block_size = block_size
        self.slots = torch.tensor(slots, dtype=torch.long, device=device)  # [T]
        self.positions = torch.tensor(positions, dtype=torch.long, device=device)  # [T]
        self.groups = [g for g in (_group(decodes, block_size, device), _group(prefills, block_size, device)) if g]


def _group(members: list[tuple[int, Any]], block_size: int, device: torch.device) -> _Group | None:
    if not members:
        return None
    width = max(len(item.tokens) for _, item in members)
    blocks = max(-(-(item.start + len(item.tokens)) // block_size) for _, item in members)
    rows: list[list[int]] = []
    q_pos: list[list[int]] = []
    tables: list[list[int]] = []
    keep: list[int] = []
    targets: list[int] = []
    for b, (offset, item) in enumerate(members):
        n = len(item.tokens)
        rows.append([offset + min(i, n - 1) for i in range(width)])
        q_pos.append([item.start + i if i < n else 0 for i in range(width)])
        table = list(item.blocks[:blocks])
        tables.append(table + [0] * (blocks - len(table)))
        keep.extend(b * width + i for i in range(n))
        targets.extend(range(offset, offset + n))
    as_long = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
    padded = len(keep) != len(members) * width
    in_order = not padded and targets == list(range(targets[0], targets[0] + len(targets)))
    return _Group(
        rows=as_long(rows),
        q_pos=as_long(q_pos),
        tables=as_long(tables),
        keep=as_long(keep) if padded else None,
        targets=as_long(targets),
        span=(targets[0], targets[0] + len(targets)) if in_order else None,
    )


@dataclass(frozen=True, slots=True)
class _LayerView:
    """What `_StepCache.update` hands the attention function in place of the keys."""

    cache: PagedKVCache
    layout: StepLayout
    layer: int


class StepCache:
    """The model's `cache` for one packed step (duck-typed like transformers' Cache where the
    models read it: `update`, `get_seq_length`)."""

    is_compileable = False

    def __init__(self, cache: PagedKVCache, layout: StepLayout):
        self.kv = cache
        self.layout = layout

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[_LayerView, None]:
        # key_states: [1, KVH, T, D] -> the cache's [T, KVH, D] rows
        self.kv.write(layer_idx, self.layout.slots, key_states[0].transpose(0, 1), value_states[0].transpose(0, 1))
        return _LayerView(cache=self.kv, layout=self.layout, layer=layer_idx), None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def paged_attention(
    module: Any,
    query: torch.Tensor,
    key: Any,
    value: Any,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query: [1, H, T, D] for the packed step; `key` is the _LayerView the cache gave. -> [1, T, H, D]."""
    view: _LayerView = key
    out = attend(
        query[0].transpose(0, 1),
        view.cache,
        view.layer,
        view.layout,
        scaling=scaling,
        window=kwargs.get("sliding_window"),
        softcap=kwargs.get("softcap"),
        sinks=kwargs.get("s_aux"),  # [H] one more logit per head that takes probability but has no value (gpt-oss)
    )
    return out[None], None


def attend(
    packed: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    layout: StepLayout,
    *,
    scaling: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """packed: the step's queries [T, H, D] -> their attention outputs [T, H, D], each query over
    its own sequence's keys (already written for this step) in the layer's blocks."""
    dim = packed.shape[2]
    groups = layout.groups
    out = None if len(groups) == 1 and groups[0].keep is None else packed.new_empty(packed.shape)
    kernel = (
        packed.device.type == "cpu"
        and softcap is None
        and sinks is None
        and decode_attention_missing(packed.dtype, dim) is None
    )
    for group in groups:
        if kernel and group.rows.shape[1] == 1:  # one query a sequence: the kernel reads the blocks in place
            q = packed[group.rows[:, 0]]  # [B, H, D]
            scale = scaling if scaling is not None else dim**-0.5
            keys, values = cache.keys[layer], cache.values[layer]
            o = decode_attention(q, keys, values, group.tables, group.q_pos[:, 0], scale, window).to(packed.dtype)
        else:
            o = _gathered(packed, cache, layer, group, scaling, window, softcap, sinks)
        if out is None:  # one group, unpadded: its rows are all the step's tokens, in order
            return o
        out.index_copy_(0, group.targets, o if group.keep is None else o.index_select(0, group.keep))
    assert out is not None  # at least one group: a step has tokens
    return out


def _gathered(
    packed: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    group: _Group,
    scaling: float | None,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """One group's queries over copies of its sequences' keys and values -> [B * Q, H, D]."""
    heads, dim = packed.shape[1], packed.shape[2]
    keys, values = cache.gather(layer, group.tables)  # [B, KVH, L, D]
    if group.span is not None:  # its tokens side by side in the step: a view, not a copy
        q = packed[group.span[0] : group.span[1]].view(*group.rows.shape, heads, dim).transpose(1, 2)
    else:
        q = packed[group.rows].transpose(1, 2)  # [B, H, Q, D]
    mask = group.mask(window, keys.shape[2])
    return _attend(q, keys, values, mask, scaling, softcap, sinks).transpose(1, 2).reshape(-1, heads, dim)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [B, H, Q, D], k/v: [B, KVH, L, D], mask: [B, 1, Q, L] (True: attend) -> [B, H, Q, D]."""
    if not softcap and sinks is None:
        if q.dtype == torch.float32:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        if k.shape[0] * k.shape[2] * q.shape[2] <= SMALL_ATTENTION:  # a few short rows: fp32 SDPA's floor is lower
            out = F.scaled_dot_product_attention(
                q.float(), k.float(), v.float(), attn_mask=mask, scale=scale, enable_gqa=True
            )
            return out.to(q.dtype)
        return _grouped(q, k, v, mask, scale)
    # SDPA has neither: soft-capped logits (Gemma 2: tanh(s / cap) * cap before the mask), and
    # sinks (gpt-oss: one more logit per head in the softmax, dropped after it)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf")).float()
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1).to(q.dtype), v)
    sink = sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs.to(q.dtype), v)


def _grouped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """Attention in bf16 / fp16 as two batched GEMMs per group of query heads that share a KV
    head, softmax in float32. PyTorch's CPU SDPA in bf16 with a mask ran 5-11x slower than in
    fp32 here (16 decoding sequences of SmolLM2's 9 query / 3 KV heads at 256 positions: 2.0 ms
    against 0.22 ms this way), which made bf16 steps slower than fp32 ones."""
    b, heads, width, dim = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    group = heads // kv_heads  # query heads h = j * group + g read KV head j (SDPA's enable_gqa)
    scores = torch.matmul(q.reshape(b, kv_heads, group * width, dim), k.transpose(-1, -2))  # [B, KVH, G*Q, L]
    scores = scores.float().view(b, kv_heads, group, width, length)
    scores = scores.mul_(scale if scale is not None else 1 / math.sqrt(dim))
    scores = scores.masked_fill_(~mask[:, :, None], float("-inf"))  # mask [B, 1, 1, Q, L]
    probs = torch.softmax(scores, dim=-1).to(q.dtype).view(b, kv_heads, group * width, length)
    return torch.matmul(probs, v).view(b, heads, width, dim)


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
