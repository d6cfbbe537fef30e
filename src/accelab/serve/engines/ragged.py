"""Continuous-batching steps for a transformers causal LM: every step's chunks (one decode
token per running sequence, prefill chunks of new ones) are packed into ONE sequence of T
tokens and run by the model's own forward, so each Linear runs once per step on [T, hidden].

Two pieces plug into the model through transformers' own extension points:
- a per-step cache object, passed as the model's `cache`: its `update(k, v, layer)` writes the
  new keys and values of each chunk at their positions in that sequence's own KV buffers
  (contiguous per sequence and layer, grown by doubling) and hands the attention the views;
- an attention function registered with `AttentionInterface` ("accelab_ragged"): for each
  chunk, scaled_dot_product_attention of its queries over its sequence's keys (causal, offset
  by the tokens already cached). The model's mask builder is skipped (no mask function is
  registered for this implementation).

Why not transformers' ContinuousBatchingManager: on this CPU it decoded 8 SmolLM2 sequences
at 51 tok/s where this runs at ~116 (its paged path reads the whole block table through a 4D
mask every step), it schedules on its own thread (the server's admission control, KV-capacity
429s, deadlines and cancellations need the step under our scheduler), and it samples with one
generation config for all requests. Shapes change every step, so the model runs eager.

A model whose attention does not follow the pattern above (sliding windows, soft-capping,
attention that reads keys after the cache update) is caught by `self_check` at start-up,
which compares the packed step's logits with the model's plain forward; the server then
falls back to the per-batch scheduler and says why.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from accelab.catalog.facts import text_config
from accelab.plan.runtime import Unsupported, input_device
from accelab.serve.engines.base import SamplingParams, StepInput, common_prefix
from accelab.serve.engines.sampling import SampledToken, sample_step

log = logging.getLogger(__name__)

ATTENTION_NAME = "accelab_ragged"
MIN_CAPACITY = 64  # positions a sequence's KV buffer starts with
PREFIX_CACHE = 8  # finished sequences kept for their prefixes (the most recent ones)
MIN_PREFIX = 4  # shorter common prefixes are computed again (not worth a copy)


@dataclass(frozen=True, slots=True)
class _Segment:
    """One chunk inside the packed step: its sequence's KV views for one layer."""

    keys: torch.Tensor  # [1, KVH, start + n, D]
    values: torch.Tensor
    start: int
    n: int


def _ragged_attention(module: Any, query: torch.Tensor, key: Any, value: Any, attention_mask: Any,
                      scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query: [1, H, T, D] for the packed step; `key` is the list of _Segment the cache gave."""
    segments: list[_Segment] = key
    outputs = []
    queries = query.split([seg.n for seg in segments], dim=2) if len(segments) > 1 else (query,)
    for seg, q in zip(segments, queries):
        if seg.n == 1 or seg.start == 0:  # one query sees everything; a fresh prompt is plain causal
            out = F.scaled_dot_product_attention(q, seg.keys, seg.values, is_causal=seg.n > 1, scale=scaling,
                                                 enable_gqa=True)
        else:  # a later prefill chunk: query i (position start + i) sees keys 0 .. start + i
            mask = torch.ones(seg.n, seg.start + seg.n, dtype=torch.bool, device=query.device).tril(seg.start)
            out = F.scaled_dot_product_attention(q, seg.keys, seg.values, attn_mask=mask, scale=scaling,
                                                 enable_gqa=True)
        outputs.append(out)
    packed = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
    return packed.transpose(1, 2).contiguous(), None  # [1, T, H, D]


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _ragged_attention)


class _KVStore:
    """Each sequence's keys and values, per layer: [KVH, capacity, D], grown by doubling."""

    def __init__(self) -> None:
        self._kv: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def buffers(self, seq_id: int, layer: int, end: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequence's [KVH, capacity, D] keys and values for `layer`, with room for `end` positions."""
        layers = self._kv.setdefault(seq_id, {})
        buffers = layers.get(layer)
        if buffers is None or buffers[0].shape[1] < end:
            buffers = layers[layer] = self._grow(buffers, end, like)
        return buffers

    @staticmethod
    def _grow(old: tuple[torch.Tensor, torch.Tensor] | None, need: int,
              like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # like: [..., KVH, n, D]
        capacity = max(need, MIN_CAPACITY, 2 * old[0].shape[1] if old is not None else 0)
        shape = (like.shape[-3], capacity, like.shape[-1])
        keys = torch.empty(shape, dtype=like.dtype, device=like.device)
        values = torch.empty(shape, dtype=like.dtype, device=like.device)
        if old is not None:
            kept = old[0].shape[1]
            keys[:, :kept] = old[0]
            values[:, :kept] = old[1]
        return keys, values

    def pop(self, seq_id: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]] | None:
        return self._kv.pop(seq_id, None)

    def adopt(self, seq_id: int, source: dict[int, tuple[torch.Tensor, torch.Tensor]], n: int) -> None:
        """Start `seq_id` with a copy of the first n positions of `source` (another sequence's layers)."""
        layers = self._kv[seq_id] = {}
        for layer, (keys, values) in source.items():
            fresh = self._grow(None, max(n, 1), keys)
            fresh[0][:, :n] = keys[:, :n]
            fresh[1][:, :n] = values[:, :n]
            layers[layer] = fresh

    def __len__(self) -> int:
        return len(self._kv)


class _StepCache:
    """The model's `cache` for one packed step (duck-typed like transformers' Cache where the
    model reads it: `update`, `get_seq_length`)."""

    is_compileable = False

    def __init__(self, store: _KVStore, inputs: list[StepInput]):
        self.store = store
        self.inputs = inputs
        self.lengths = [len(item.tokens) for item in inputs]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[list[_Segment], None]:
        # key_states: [1, KVH, T, D], T = all chunks' tokens packed
        lengths = self.lengths
        new_keys, new_values = key_states[0].split(lengths, dim=1), value_states[0].split(lengths, dim=1)
        segments, targets = [], []
        for item, n in zip(self.inputs, lengths):
            end = item.start + n
            keys, values = self.store.buffers(item.seq_id, layer_idx, end, key_states)
            targets += (keys[:, item.start:end], values[:, item.start:end])
            segments.append(_Segment(keys=keys[None, :, :end], values=values[None, :, :end], start=item.start, n=n))
        sources = [t for pair in zip(new_keys, new_values) for t in pair]
        torch._foreach_copy_(targets, sources)  # every chunk's new keys and values in one call
        return segments, None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


class RaggedTorchEngine:
    """Steps of many sequences through one forward of a transformers causal LM (see the module
    docstring). Owns the model's attention setting while it lives; `close` restores it."""

    name = "packed steps over the model's own forward (accelab_ragged attention)"

    def __init__(self, runnable: Any):
        model = runnable.model
        config = getattr(model, "config", None)
        if config is None or not hasattr(model, "set_attn_implementation"):
            raise Unsupported(f"{type(model).__name__} is not a transformers model: continuous batching needs one")
        text = text_config(config)
        window = getattr(text, "sliding_window", None)
        if window or any(t != "full_attention" for t in (getattr(text, "layer_types", None) or ())):
            raise Unsupported(f"{type(model).__name__} uses sliding-window attention, which the packed continuous "
                              "steps do not implement")
        if runnable.plan is not None and getattr(runnable.plan, "compile", "off") != "off":
            raise Unsupported("the plan compiles the model; the continuous steps change shape every step and would "
                              "recompile each time")
        self.runnable = runnable
        self.model = model
        self.device = input_device(model, runnable.device)
        self._cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.kv_bytes_per_token = _kv_bytes_per_token(text, _dtype_of(model))
        self._store = _KVStore()
        self._tokens: dict[int, list[int]] = {}  # the tokens each sequence's KV holds
        self._finished: list[tuple[list[int], dict]] = []  # (tokens, layers) of recent ones, oldest first
        self._original_attention = config._attn_implementation
        _register()
        model.set_attn_implementation(ATTENTION_NAME)
        self._head = _transposed_head(model)

    # -- the step -------------------------------------------------------------------------
    def step(self, inputs: list[StepInput]) -> list[SampledToken]:
        logits = self._forward(inputs)
        return sample_step(logits, [item for item in inputs if item.sample])

    def _forward(self, inputs: list[StepInput]) -> torch.Tensor:
        """Logits [N, V] at the last token of each input that samples."""
        ids: list[int] = []
        positions: list[int] = []
        keep: list[int] = []
        for item in inputs:
            held = self._tokens.setdefault(item.seq_id, [])
            del held[item.start:]
            held.extend(item.tokens)
            ids.extend(item.tokens)
            positions.extend(range(item.start, item.start + len(item.tokens)))
            if item.sample:
                keep.append(len(ids) - 1)
        device = self.device
        batch = {
            "input_ids": torch.tensor([ids], dtype=torch.long, device=device),  # [1, T]
            "position_ids": torch.tensor([positions], dtype=torch.long, device=device),
            self._cache_kwarg: _StepCache(self._store, inputs),
            "use_cache": True,
            "logits_to_keep": torch.tensor(keep or [len(ids) - 1], dtype=torch.long, device=device),
        }
        with torch.inference_mode(), self.runnable.context():
            logits = self.model(**batch).logits[0]  # [N, V]
        return logits[: len(keep)]

    def release(self, seq_id: int) -> None:
        layers, tokens = self._store.pop(seq_id), self._tokens.pop(seq_id, None)
        if layers and tokens:
            self._finished.append((tokens, layers))
            del self._finished[:-PREFIX_CACHE]

    def fork(self, parent_seq_id: int, child_seq_id: int, n_tokens: int) -> None:
        """The child starts with a copy of the parent's first n_tokens positions (n > 1 choices)."""
        self._store.adopt(child_seq_id, self._store._kv[parent_seq_id], n_tokens)
        self._tokens[child_seq_id] = list(self._tokens[parent_seq_id][:n_tokens])

    def score(self, tokens: Sequence[int]) -> torch.Tensor:
        """Logits [len(tokens), V] of every position (prompt logprobs), by the model's own forward."""
        return self._reference_logits(list(tokens))

    def reuse_prefix(self, seq_id: int, tokens: Sequence[int]) -> int:
        """A new sequence starts with a copy of the longest prefix of `tokens` that a recent
        finished sequence computed (a chat template and system prompt); returns its length."""
        best, source = 0, None
        for index, (held, layers) in enumerate(self._finished):
            n = common_prefix(held, tokens)
            if n > best:
                best, source = n, index
        if source is None or best < MIN_PREFIX:
            return 0
        held, layers = self._finished.pop(source)
        self._finished.append((held, layers))  # most recently used last
        self._store.adopt(seq_id, layers, best)
        self._tokens[seq_id] = list(tokens[:best])
        return best

    def close(self) -> None:
        self._store = _KVStore()
        self._finished.clear()
        if self._head is not None:
            with contextlib.suppress(AttributeError):
                del self._head.forward  # back to the class's forward
        with contextlib.suppress(Exception):
            self.model.set_attn_implementation(self._original_attention)

    # -- start-up check -----------------------------------------------------------------------
    def self_check(self, prompt: list[int]) -> str | None:
        """None when the packed steps give the model's own logits for `prompt` (fed in two
        chunks, then one decode step), else what differed."""
        if len(prompt) < 3:
            raise ValueError("self_check needs a prompt of 3 tokens or more")
        greedy = SamplingParams(max_tokens=1, temperature=0)
        cut = len(prompt) // 2
        seq = -1  # an id the scheduler never hands out
        try:
            self._forward([StepInput(seq_id=seq, start=0, tokens=tuple(prompt[:cut]), sample=False, params=greedy)])
            packed = self._forward([StepInput(seq_id=seq, start=cut, tokens=tuple(prompt[cut:]), sample=True,
                                              params=greedy)])[0]
            nxt = int(packed.argmax())
            decoded = self._forward([StepInput(seq_id=seq, start=len(prompt), tokens=(nxt,), sample=True,
                                               params=greedy)])[0]
        except Exception as err:  # noqa: BLE001 - any failure means: not this model
            return f"the packed step failed: {type(err).__name__}: {err}"
        finally:
            self.release(seq)
        reference = self._reference_logits(prompt + [nxt])
        for got, want, where in ((packed, reference[-2], "after the prompt"), (decoded, reference[-1], "one step on")):
            scale = float(want.abs().max()) or 1.0
            error = float((got.float() - want.float()).abs().max()) / scale
            if error > _tolerance(got.dtype):
                return f"its logits {where} differ from the model's own forward by {error:.2%} of their scale"
        return None

    def _reference_logits(self, ids: list[int]) -> torch.Tensor:
        attention = self.model.config._attn_implementation
        self.model.set_attn_implementation(self._original_attention)
        try:
            with torch.inference_mode(), self.runnable.context():
                batch = torch.tensor([ids], dtype=torch.long, device=self.device)
                return self.model(input_ids=batch, use_cache=False).logits[0]
        finally:
            self.model.set_attn_implementation(attention)



def _transposed_head(model: Any) -> torch.nn.Linear | None:
    """Compute the output layer as (W @ h^T)^T: the vocabulary-sized GEMM with a few rows of h
    (one per sampled sequence) ran 2.4x faster that way than as F.linear on this project's CPUs
    (MKL: 49152x576 fp32 weight, 8 rows: 5.6 ms against 13.3 ms; 1 row: the same). Only for a
    plain Linear with a float weight and no bias; anything else keeps its own forward."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear or head.bias is not None or type(head.weight) is not torch.nn.Parameter:
        return None
    weight = head.weight

    def forward(hidden: torch.Tensor) -> torch.Tensor:  # hidden: [..., H] -> [..., V]
        flat = hidden.reshape(-1, hidden.shape[-1])
        return torch.mm(weight, flat.t()).t().reshape(*hidden.shape[:-1], weight.shape[0])

    head.forward = forward
    return head


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-3 if dtype == torch.float32 else 5e-2


def _dtype_of(model: Any) -> torch.dtype:
    try:
        return next(p.dtype for p in model.parameters() if p.is_floating_point())
    except StopIteration:
        return torch.float32


def _kv_bytes_per_token(text_config: Any, dtype: torch.dtype) -> int:
    layers = text_config.num_hidden_layers
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
