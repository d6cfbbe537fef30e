"""The llama.cpp decoding engine: a GGUF model and one context, batched prefill and decode of
several sequences per `llama_decode`, greedy or sampled through transformers' own logits
processors. `accelab.backends.llamacpp` builds it for a plan; the server's continuous llama.cpp
steps (`serve/runner/llama_steps.py`) drive its model and contexts directly."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Context:
    ctx: Any  # llama_context_p
    n_ctx: int
    n_seq: int


class LlamaEngine:
    """A llama.cpp model and one context, grown when a call needs more sequences or positions."""

    def __init__(self, path: Path, *, threads: int, n_ctx: int, n_batch: int, gpu_layers: int):
        import llama_cpp
        from llama_cpp import Llama

        self.version = llama_cpp.__version__
        self.threads, self.n_ctx, self.n_batch = threads, n_ctx, n_batch
        # Llama loads the weights (mmap) and silences llama.cpp's logging; its own context is
        # left minimal: decoding runs on contexts made here, with as many sequences as the batch
        llm = Llama(
            model_path=str(path),
            n_ctx=32,
            n_batch=32,
            n_threads=threads,
            n_threads_batch=threads,
            n_gpu_layers=gpu_layers,
            verbose=False,
        )
        self.llm: Llama | None = llm  # None once closed
        self.n_vocab = llm.n_vocab()
        self.eos = llm.token_eos()
        self._context: _Context | None = None
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        log.info("llama.cpp loaded %s (%d threads)", path, threads)

    def close(self) -> None:
        import llama_cpp

        if self._context is not None:
            llama_cpp.llama_free(self._context.ctx)
            self._context = None
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if self.llm is not None:
            self.llm.close()
            self.llm = None

    @property
    def model(self) -> Any:
        """llama.cpp's model (the weights), which the contexts made here and beside it share."""
        assert self.llm is not None, "the llama.cpp engine is closed"
        return self.llm.model

    # contexts
    def context(self, n_seq: int, n_tokens: int) -> Any:
        """An empty context with room for n_seq sequences and n_tokens positions over all of them."""
        import llama_cpp

        current = self._context
        if current is None or current.n_seq < n_seq or current.n_ctx < n_tokens:
            if current is not None:
                llama_cpp.llama_free(current.ctx)
                self._context = None
            size = max(self.n_ctx, -(-n_tokens // 256) * 256)
            params = llama_cpp.llama_context_default_params()
            params.n_ctx, params.n_seq_max, params.kv_unified = size, max(n_seq, 1), True
            params.n_batch = params.n_ubatch = self.n_batch
            params.n_threads = params.n_threads_batch = self.threads
            params.no_perf = True
            ctx = llama_cpp.llama_init_from_model(self.model, params)
            if not ctx:
                raise RuntimeError(f"llama.cpp could not create a context of {size} positions for {n_seq} sequences")
            self._context = current = _Context(ctx=ctx, n_ctx=size, n_seq=max(n_seq, 1))
            log.info("llama.cpp context: %d positions, %d sequences", size, n_seq)
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(current.ctx), True)
        return current.ctx

    def decode(self, ctx: Any, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) entries (<= n_batch)."""
        decode_entries(ctx, self._batch, entries)

    def logits(self, ctx: Any, index: int) -> np.ndarray:
        """The logits of the index-th output of the last decode: [n_vocab] (a view: copy to keep)."""
        import llama_cpp

        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, index), shape=(self.n_vocab,))

    def prefill(
        self, ctx: Any, prompts: list[list[int]], *, all_logits: bool = False, seqs: list[int] | None = None
    ) -> list[np.ndarray]:
        """Decode every prompt (prompt i as sequence seqs[i], by default i), n_batch tokens per
        call. Returns the last position's logits per prompt, or with all_logits every
        position's ([len, V] each)."""
        seqs = list(range(len(prompts))) if seqs is None else seqs
        entries = [
            (tok, pos, i, all_logits or pos == len(p) - 1) for i, p in enumerate(prompts) for pos, tok in enumerate(p)
        ]
        out: list[list[np.ndarray]] = [[] for _ in prompts]
        for start in range(0, len(entries), self.n_batch):
            chunk = entries[start : start + self.n_batch]
            self.decode(ctx, [(tok, pos, seqs[i], wants) for tok, pos, i, wants in chunk])
            for j, (_, _, i, wants) in enumerate(chunk):
                if wants:
                    out[i].append(self.logits(ctx, j).copy())
        return [np.stack(rows) if all_logits else rows[-1] for rows in out]

    def prefill_shared(self, ctx: Any, prompts: list[list[int]]) -> list[np.ndarray]:
        """The last position's logits of every prompt (prompt i as sequence i), a prompt that
        several rows repeat decoded once, as the sequence of its first row, and its cells shared
        with the others (`llama_memory_seq_cp`: no copy, a cell belongs to several sequences).
        Why: the server's n > 1 choices are rows of one prompt; decoded as copies side by side,
        they would not even get the same logits (ggml's CPU flash attention takes another
        kernel, rounding otherwise, from 64 tokens a decode on) and greedy choices would differ."""
        import llama_cpp

        first: dict[tuple[int, ...], int] = {}  # prompt -> the first row that has it
        for row, p in enumerate(prompts):
            first.setdefault(tuple(p), row)
        rows = list(first.values())
        logits = dict(zip(rows, self.prefill(ctx, [prompts[r] for r in rows], seqs=rows)))
        memory = llama_cpp.llama_get_memory(ctx)
        for row, p in enumerate(prompts):
            if first[tuple(p)] != row:
                llama_cpp.llama_memory_seq_cp(memory, first[tuple(p)], row, 0, len(p))
        return [logits[first[tuple(p)]] for p in prompts]

    # the Runnable's generate_fn
    def generate(
        self,
        batch: dict[str, torch.Tensor],
        max_new_tokens: int,
        min_new_tokens: int | None = None,
        do_sample: bool = False,
        stopping_criteria: Any = None,
        pad_token_id: int | None = None,
        **sampling: Any,
    ) -> torch.Tensor:
        """Decode every row; returns [B, prompt + new] like transformers' generate (finished rows
        are padded). Sampling takes generate's logits_processor, temperature, top_k and top_p."""
        pick = token_picker(do_sample, **sampling)
        ids = batch["input_ids"].cpu()
        mask = batch.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask.cpu()
        prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]  # left padding removed
        lengths = [len(p) for p in prompts]
        b, width = ids.shape
        pad = self.eos if pad_token_id is None else pad_token_id
        out = torch.full((b, width + max_new_tokens), pad, dtype=torch.long)  # [B, prompt + new]
        out[:, :width] = ids
        criteria = list(stopping_criteria or [])
        finished = torch.zeros(b, dtype=torch.bool)

        ctx = self.context(b, sum(lengths) + b * max_new_tokens)
        # prefill: one decode of every distinct prompt; note: TTFT covers it and the first pick
        tokens = pick(np.stack(self.prefill_shared(ctx, prompts)), out[:, :width])  # [B]
        for step in range(max_new_tokens):
            end = width + step + 1
            out[:, end - 1] = torch.where(finished, pad, tokens)
            if step + 1 >= (min_new_tokens or 0):
                finished |= tokens == self.eos
            if _stop(criteria, out[:, :end]) or bool(finished.all()) or end == out.shape[1]:
                return out[:, :end]
            self.decode(ctx, [(int(t), lengths[i] + step, i, True) for i, t in enumerate(tokens)])
            tokens = pick(np.stack([self.logits(ctx, i) for i in range(b)]), out[:, :end])
        return out[:, :width]  # max_new_tokens == 0

    def score(self, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Logits of every position of every row, [B, S, V]; padded positions are zeros."""
        mask = torch.ones_like(ids) if mask is None else mask
        logits = torch.zeros(*ids.shape, self.n_vocab)
        for r, (row, m) in enumerate(zip(ids.cpu(), mask.cpu().bool())):
            tokens = row[m].tolist()
            if tokens:
                ctx = self.context(1, len(tokens))
                logits[r, m] = torch.from_numpy(self.prefill(ctx, [tokens], all_logits=True)[0])
        return logits


def decode_entries(ctx: Any, batch: Any, entries: list[tuple[int, int, int, bool]]) -> None:
    """Fill a llama_batch with (token, position, sequence, wants logits) entries and decode it."""
    import llama_cpp

    batch.n_tokens = len(entries)
    for i, (token, pos, seq, logits) in enumerate(entries):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
        batch.seq_id[i][0] = seq
    code = llama_cpp.llama_decode(ctx, batch)
    if code != 0:
        raise RuntimeError(
            f"llama_decode returned {code} for {len(entries)} tokens"
            + (" (no free KV cells: raise --kv-cache-tokens)" if code == 1 else "")
        )


Picker = Callable[[np.ndarray, torch.Tensor], torch.Tensor]  # (logits [B, V], ids so far [B, S]) -> [B]


def token_picker(
    do_sample: bool,
    logits_processor: Any = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    **_: Any,
) -> Picker:
    """Greedy argmax, or sampling through generate's processors and warpers (the same classes)."""
    if not do_sample:
        return lambda logits, ids: torch.from_numpy(logits.argmax(axis=1)).long()

    steps = list(logits_processor or [])
    if temperature is not None and temperature != 1.0:
        steps.append(TemperatureLogitsWarper(temperature))
    if top_k:
        steps.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        steps.append(TopPLogitsWarper(top_p))

    def sample(logits: np.ndarray, ids: torch.Tensor) -> torch.Tensor:
        scores = torch.from_numpy(logits)  # a copy of llama.cpp's buffer (np.stack): processors may write
        for step in steps:
            scores = step(ids, scores)
        return torch.multinomial(torch.softmax(scores.float(), dim=-1), 1)[:, 0]

    return sample


def _stop(criteria: list[Any], input_ids: torch.Tensor) -> bool:
    """Call every criterion once (each must see every step); stop when one says all rows are done."""
    stop = False
    for criterion in criteria:
        done = criterion(input_ids, None)
        stop |= bool(torch.as_tensor(done).all())
    return stop
