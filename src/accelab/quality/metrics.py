"""Fidelity of a plan's outputs against the fp32 eager reference. Pure numpy: no torch, no I/O.

Outputs are plain dicts of numpy arrays (what crosses the process boundary):
- classification: {"logits": [N, C], "labels": [N] (optional)}
- feature extraction: {"embeddings": [N, D]}
- generation: {"tokens": [N, T] of int, "nll": float (mean per token), "nll_tokens": int}
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np


def classification(ref: dict[str, Any], cand: dict[str, Any]) -> dict[str, float]:
    a, b = np.asarray(ref["logits"], dtype=np.float64), np.asarray(cand["logits"], dtype=np.float64)
    _same_shape(a, b, "logits")
    top1 = float(np.mean(a.argmax(-1) == b.argmax(-1)))
    k = min(5, a.shape[-1])
    top_a, top_b = np.argsort(-a, axis=-1)[:, :k], np.argsort(-b, axis=-1)[:, :k]
    overlap = float(np.mean([len(set(x) & set(y)) / k for x, y in zip(top_a, top_b)]))
    rel = np.linalg.norm(a - b, axis=-1) / np.maximum(np.linalg.norm(a, axis=-1), 1e-12)
    metrics = {"top1_agreement": top1, "top5_overlap": overlap, "logit_rel_error": float(rel.max())}
    labels = ref.get("labels")
    if labels is not None and len(labels):
        labels = np.asarray(labels)
        metrics["accuracy_ref"] = float(np.mean(a.argmax(-1) == labels))
        metrics["accuracy"] = float(np.mean(b.argmax(-1) == labels))
        metrics["accuracy_change"] = metrics["accuracy"] - metrics["accuracy_ref"]
    return metrics


def embeddings(ref: dict[str, Any], cand: dict[str, Any]) -> dict[str, float]:
    a, b = np.asarray(ref["embeddings"], dtype=np.float64), np.asarray(cand["embeddings"], dtype=np.float64)
    _same_shape(a, b, "embeddings")
    cos = np.sum(a * b, axis=-1) / np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1), 1e-12)
    return {
        "cosine_min": float(cos.min()),
        "cosine_mean": float(cos.mean()),
        "max_abs_diff": float(np.abs(a - b).max()),
    }


def generation(ref: dict[str, Any], cand: dict[str, Any]) -> dict[str, float | None]:
    a, b = np.asarray(ref["tokens"]), np.asarray(cand["tokens"])
    _same_shape(a, b, "generated tokens")
    equal = a == b
    # first divergence per prompt: index of the first differing token, T when identical
    first = np.where(equal.all(-1), a.shape[-1], np.argmin(equal, axis=-1))
    metrics: dict[str, float | None] = {
        "token_agreement": float(equal.mean()),
        "prefix_agreement": float(np.mean(first / a.shape[-1])),  # matching prefix, as a fraction
        "first_divergence_min": int(first.min()) if (first < a.shape[-1]).any() else None,
        "exact_match_rate": float(np.mean(equal.all(-1))),
    }
    if ref.get("nll") is not None and cand.get("nll") is not None:
        ppl_ref, ppl = math.exp(ref["nll"]), math.exp(cand["nll"])
        metrics.update(perplexity_ref=ppl_ref, perplexity=ppl, perplexity_change=ppl / ppl_ref - 1)
    return metrics


def _same_shape(a: np.ndarray, b: np.ndarray, what: str) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{what} differ in shape: reference {a.shape}, candidate {b.shape}")


METRICS: dict[str, Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]] = {
    "image-classification": classification,
    "feature-extraction": embeddings,
    "text-generation": generation,
    "image-text-to-text": generation,
}


def compare(task: str, ref: dict[str, Any], cand: dict[str, Any]) -> dict[str, Any]:
    return METRICS[task](ref, cand)
