"""Teacher-forced scoring of the evaluation text in windows (runs in the measuring child).

The text (`catalog.samples.evaluation_text`, ~64k SmolLM2 tokens) is cut into non-overlapping
windows of `window_tokens` tokens. The first `context_tokens` of each window are context only:
a position with a few tokens before it predicts from almost nothing, as llama.cpp scores only
the second half of each chunk. Every later position is scored: what the model predicts for the
text's next token. Which windows: a seeded permutation of all of them, so a run with more
samples scores a superset of a smaller run's windows (a larger sample refines an answer, it
does not replace it), spread over the whole text (essay and every topic of the reference).

Per scored position a model keeps its `top_k` log-probabilities (most likely first) and the
log-probability of the text's own token: [W, P, k] ids and log-probs, [W, P] target log-probs.
The reference's are cached with it (`verify.reference_outputs`): ~1.6 MB at 32 windows (k=64), where
its full logits would be ~600 MB.

How each runtime scores (what `metrics.token_kl` then compares):
- torch plans, llama.cpp (every position's logits, `LlamaCppModel`), ONNX Runtime / OpenVINO
  graphs: full logits in the plan's precision; log-softmax and top-k here.
- vLLM and OpenVINO GenAI (engine processes, `EngineModel.score_top`): the engine's top-k
  log-probabilities per prompt position. OpenVINO's engine computes them from full logits of its
  exported graph (any k); vLLM's prompt logprobs give at most its max_logprobs (20) per position,
  so the KL there runs over the ids in both top lists, fewer than with k=32 (still a lower bound).
Vision-language models: each window follows one photo and its question (the chat template with
the image), so every scored token is also conditioned on the image.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from typing import Any

import numpy as np
import torch

from accelab.catalog import inputs
from accelab.plan.runtime import Runnable, input_device, to_device

log = logging.getLogger(__name__)

SEED = 0


@functools.cache
def _text_ids(tokenizer: Any) -> tuple[int, ...]:
    return tuple(tokenizer(inputs.evaluation_text(), add_special_tokens=False, verbose=False)["input_ids"])


def text_windows(tokenizer: Any, count: int, window_tokens: int) -> np.ndarray:
    """`count` windows [W, window_tokens] of the evaluation text, the same on every run."""
    ids = np.asarray(_text_ids(tokenizer), dtype=np.int64)
    available = len(ids) // window_tokens
    if count > available:
        raise ValueError(
            f"the quality guard asks {count} windows of {window_tokens} tokens; the evaluation text has "
            f"{available}: pass fewer --samples"
        )
    order = np.random.default_rng(SEED).permutation(available)[:count]
    return np.stack([ids[i * window_tokens : (i + 1) * window_tokens] for i in order])


def digest(windows: np.ndarray, context_tokens: int) -> str:
    """What was scored: the windows' tokens and where scoring starts."""
    return hashlib.sha256(windows.astype(np.int64).tobytes() + str(context_tokens).encode()).hexdigest()[:16]


def score_windows(runnable: Runnable, windows: np.ndarray, *, context_tokens: int, top_k: int, batch_size: int) -> dict:
    """{"top_ids" [W, P, k], "top_logprobs" [W, P, k], "target_logprobs" [W, P], "candidate_topk"}."""
    score_top = getattr(runnable.model, "score_top", None)  # engine processes: no logits here
    if score_top is not None:
        rows = [score_top([int(t) for t in w], top_k) for w in windows]
        k = min(len(r.top_ids[0]) for r in rows)
        return {
            "top_ids": np.stack([np.asarray(r.top_ids, dtype=np.int32)[context_tokens - 1 :, :k] for r in rows]),
            "top_logprobs": np.stack(
                [np.asarray(r.top_logprobs, dtype=np.float32)[context_tokens - 1 :, :k] for r in rows]
            ),
            "target_logprobs": np.stack([np.asarray(r.logprobs, dtype=np.float32)[context_tokens - 1 :] for r in rows]),
            "candidate_topk": f"top-{k} ({runnable.plan.backend if runnable.plan else 'engine'} engine)",
        }
    if runnable.task == "image-text-to-text":
        parts = [_score_image_window(runnable, w, i, context_tokens, top_k) for i, w in enumerate(windows)]
    else:
        parts = [
            _score_text_batch(runnable, windows[start : start + batch_size], batch_size, context_tokens, top_k)
            for start in range(0, len(windows), batch_size)
        ]
    return {
        "top_ids": np.concatenate([p[0] for p in parts]),
        "top_logprobs": np.concatenate([p[1] for p in parts]),
        "target_logprobs": np.concatenate([p[2] for p in parts]),
        "candidate_topk": f"top-{top_k} of full logits",
    }


Scored = tuple[np.ndarray, np.ndarray, np.ndarray]  # top ids [B, P, k], top log-probs [B, P, k], target [B, P]


def _score_text_batch(runnable: Runnable, rows: np.ndarray, batch_size: int, context: int, top_k: int) -> Scored:
    """One batch of windows; a short last batch is filled up with copies (compiled plans keep one
    shape) whose results are dropped."""
    real = len(rows)
    if real < batch_size:
        rows = np.concatenate([rows, np.repeat(rows[-1:], batch_size - real, axis=0)])
    ids = torch.from_numpy(rows).to(input_device(runnable.model, runnable.device))
    with torch.inference_mode(), runnable.context():
        logits = runnable.model(input_ids=ids).logits  # [B, L, V]
    return _top(logits[:real, context - 1 : -1], ids[:real, context:], top_k)


def _score_image_window(runnable: Runnable, window: np.ndarray, index: int, context: int, top_k: int) -> Scored:
    """A photo and its question (as generation prompts them), then the window as the answer."""
    batch = inputs.generate_batch(runnable.as_loaded(), 1, offset=index)
    prompt = batch["input_ids"].shape[1]
    text = torch.from_numpy(window)[None]
    for key, value in list(batch.items()):  # every per-token input grows by the window
        if key != "input_ids" and value.dim() == 2 and value.shape[1] == prompt:
            fill = 1 if key == "attention_mask" else 0
            batch[key] = torch.cat([value, torch.full_like(text, fill, dtype=value.dtype)], dim=1)
    batch["input_ids"] = torch.cat([batch["input_ids"], text], dim=1)
    batch = to_device(batch, input_device(runnable.model, runnable.device))
    with torch.inference_mode(), runnable.context():
        logits = runnable.model(**batch).logits  # [1, prompt + L, V]
    return _top(logits[:, prompt + context - 1 : -1], batch["input_ids"][:, prompt + context :], top_k)


def _top(logits: torch.Tensor, targets: torch.Tensor, top_k: int) -> Scored:
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [B, P, V]
    top = logprobs.topk(top_k, dim=-1)  # sorted: the most likely id first
    target = logprobs.gather(-1, targets.to(logprobs.device)[..., None])[..., 0]
    return (
        top.indices.to(torch.int32).cpu().numpy(),
        top.values.cpu().numpy(),
        target.cpu().numpy(),
    )
