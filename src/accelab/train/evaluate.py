"""Evaluation on the prepared eval dataloader, metrics gathered from every rank.

`gather_for_metrics` drops the samples accelerate repeats to give every rank an equal share of
the last batch, so each eval sample counts exactly once (`samples` == the eval set's size).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F


@torch.no_grad()
def evaluate(accelerator: Any, model: Any, loader: Any, task: str) -> dict[str, float]:
    was_training = model.training
    model.eval()
    try:
        if task == "image-classification":
            return _classification(accelerator, model, loader)
        return _language_model(accelerator, model, loader)
    finally:
        model.train(was_training)


def _classification(accelerator: Any, model: Any, loader: Any) -> dict[str, float]:
    correct, losses, count = 0, 0.0, 0
    for batch in loader:
        logits = model(pixel_values=batch["pixel_values"]).logits.float()  # [B, num_labels]
        loss = F.cross_entropy(logits, batch["labels"], reduction="none")  # [B]
        preds, labels, loss = accelerator.gather_for_metrics((logits.argmax(-1), batch["labels"], loss))
        correct += int((preds == labels).sum())  # note: host sync, once per batch
        losses += float(loss.sum())
        count += len(labels)
    return {"accuracy": correct / count, "loss": losses / count, "samples": count}


def _language_model(accelerator: Any, model: Any, loader: Any) -> dict[str, float]:
    nll, tokens, count = 0.0, 0, 0
    for batch in loader:
        ids = batch["input_ids"]  # [B, T]
        logits = model(input_ids=ids).logits.float()  # [B, T, V]
        per_token = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")  # [B, T-1]
        sums, counts = per_token.sum(1), torch.full_like(per_token[:, 0], per_token.shape[1])
        sums, counts = accelerator.gather_for_metrics((sums, counts))
        nll += float(sums.sum())
        tokens += int(counts.sum())
        count += len(sums)
    loss = nll / tokens
    return {"perplexity": math.exp(loss), "loss": loss, "samples": count, "tokens": tokens}
