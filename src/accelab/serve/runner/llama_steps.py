"""Continuous batching on llama.cpp: the StepEngine of a llama.cpp Runnable (plan backend=llamacpp).

It lives with the server, which is its only user: the backend loads the model (`accelab.backends.
llamacpp`), and the server decodes many sequences through it step by step, as llama.cpp's own
server schedules slots.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from accelab.backends.llama_engine import LlamaEngine, decode_entries
from accelab.serve.engines.base import common_prefix
from accelab.serve.runner.sampling import SampledToken, sample_step

log = logging.getLogger(__name__)


PREFIX_KEEP = 256  # tokens a finished sequence leaves in its slot, for the next one to reuse


class LlamaStepEngine:
    """Continuous-batching steps on llama.cpp: every sequence lives in one context under its own
    sequence id (a slot, reused as sequences finish), as llama.cpp's own server does; a step is
    one llama_decode of every chunk's tokens, each tagged with its slot and position.

    A finished sequence leaves its first PREFIX_KEEP tokens in its slot; a new sequence takes
    the free slot that shares the longest prefix with it (`reuse_prefix`) and is prefilled
    from there. The context holds the scheduler's KV tokens plus those leftovers."""

    name = "llama.cpp sequences of one context (one llama_decode per step, prefix reuse per slot)"

    def __init__(self, engine: LlamaEngine, *, max_sequences: int, kv_tokens: int, max_step_tokens: int):
        import llama_cpp

        self.engine = engine
        model = engine.model
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_seq_max, params.kv_unified = kv_tokens + max_sequences * PREFIX_KEEP, max_sequences, True
        params.n_batch = params.n_ubatch = max_step_tokens
        params.n_threads = params.n_threads_batch = engine.threads
        params.no_perf = True
        self._ctx = llama_cpp.llama_init_from_model(model, params)
        if not self._ctx:
            raise RuntimeError(
                f"llama.cpp could not create a context of {kv_tokens} positions for {max_sequences} "
                "sequences; lower --kv-cache-tokens"
            )
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self._batch = llama_cpp.llama_batch_init(max_step_tokens, 0, 1)
        self._max_step_tokens = max_step_tokens
        self._slots: dict[int, int] = {}  # sequence -> slot (llama.cpp's seq_id)
        self._free_slots = list(range(max_sequences))  # least recently used first
        self._held: dict[int, list[int]] = {slot: [] for slot in range(max_sequences)}  # tokens in each slot
        head_dim = llama_cpp.llama_model_n_embd(model) // llama_cpp.llama_model_n_head(model)
        # f16 keys and values (llama.cpp's default cache type)
        self.kv_bytes_per_token = (
            2 * llama_cpp.llama_model_n_layer(model) * llama_cpp.llama_model_n_head_kv(model) * head_dim * 2
        )
        log.info(
            "llama.cpp continuous context: %d positions, %d sequences", llama_cpp.llama_n_ctx(self._ctx), max_sequences
        )

    def step(self, inputs: list[Any]) -> list[SampledToken]:
        entries: list[tuple[int, int, int, bool]] = []  # (token, position, slot, wants logits)
        for item in inputs:
            slot = self._slot(item.seq_id)
            self._truncate(slot, item.start)  # a chunk run again (a failed step's retry) overwrites
            self._held[slot].extend(item.tokens)
            last = len(item.tokens) - 1
            entries.extend((tok, item.start + i, slot, item.sample and i == last) for i, tok in enumerate(item.tokens))
        if len(entries) > self._max_step_tokens:
            raise ValueError(f"a step of {len(entries)} tokens; this context takes {self._max_step_tokens}")
        decode_entries(self._ctx, self._batch, entries)
        rows = [i for i, entry in enumerate(entries) if entry[3]]
        if not rows:
            return []
        logits = torch.from_numpy(np.stack([self.engine.logits(self._ctx, i) for i in rows]))  # [N, V], a copy
        return sample_step(logits, [item for item in inputs if item.sample])

    def fork(self, parent_seq_id: int, child_seq_id: int, n_tokens: int) -> None:
        """The child's slot shares the parent's first n_tokens cells (llama.cpp copies no KV: a
        cell of a unified cache belongs to several sequences)."""
        import llama_cpp

        parent = self._slots[parent_seq_id]
        child = self._slot(child_seq_id)
        self._truncate(child, 0)
        llama_cpp.llama_memory_seq_cp(self._memory, parent, child, 0, n_tokens)
        self._held[child] = list(self._held[parent][:n_tokens])

    def score(self, tokens: Any) -> torch.Tensor:
        """Logits [len(tokens), V] of every position (prompt logprobs), in a context of their own."""
        return self.engine.score(torch.tensor([list(tokens)], dtype=torch.long), None)[0]

    def reuse_prefix(self, seq_id: int, tokens: Any) -> int:
        """Give a new sequence the free slot holding the longest prefix of `tokens`; returns its length."""
        if not self._free_slots:
            raise RuntimeError(
                "every llama.cpp sequence slot is taken; the scheduler ran more sequences than the context was made for"
            )
        best = max(self._free_slots, key=lambda slot: common_prefix(self._held[slot], tokens))
        n = common_prefix(self._held[best], tokens)
        slot = best if n else self._free_slots[0]  # no match: the least recently used slot
        self._free_slots.remove(slot)
        self._slots[seq_id] = slot
        self._truncate(slot, n)
        return n

    def _slot(self, seq_id: int) -> int:
        slot = self._slots.get(seq_id)
        return slot if slot is not None else self._slots.setdefault(seq_id, self._claim_empty())

    def _claim_empty(self) -> int:
        self.reuse_prefix(-1, ())
        return self._slots.pop(-1)

    def _truncate(self, slot: int, keep: int) -> None:
        """Drop the slot's cells from position `keep` on."""
        import llama_cpp

        held = self._held[slot]
        if len(held) > keep:
            llama_cpp.llama_memory_seq_rm(self._memory, slot, keep, -1)
            del held[keep:]

    def release(self, seq_id: int) -> None:
        slot = self._slots.pop(seq_id, None)
        if slot is not None:
            self._truncate(slot, PREFIX_KEEP)
            self._free_slots.append(slot)

    def close(self) -> None:
        import llama_cpp

        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx is not None:
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
