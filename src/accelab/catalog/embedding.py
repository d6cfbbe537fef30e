"""Sentence embeddings the sentence-transformers way: mean over real tokens, then L2 norm."""

from __future__ import annotations

from typing import Any

import torch


def embed(model_output: Any, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, S, H] token features -> [B, H] unit vectors (all-MiniLM-L6-v2's pooling).

    `model_output` is the model's output (with `last_hidden_state`, or a tuple whose first item
    is it) or the hidden states tensor itself. Padding positions (mask 0) are left out.
    """
    hidden = _last_hidden_state(model_output)  # [B, S, H]
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)  # [B, S, 1]
    summed = (hidden * mask).sum(dim=1)
    counts = mask.sum(dim=1).clamp(min=1e-9)
    return torch.nn.functional.normalize(summed / counts, p=2, dim=1)


def _last_hidden_state(model_output: Any) -> torch.Tensor:
    if isinstance(model_output, torch.Tensor):
        return model_output
    hidden = getattr(model_output, "last_hidden_state", None)
    if hidden is None:
        hidden = model_output[0]
    return hidden
