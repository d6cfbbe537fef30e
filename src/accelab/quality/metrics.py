"""Fidelity of a plan's outputs against the fp32 eager reference, with 95% intervals. Pure numpy
(and `intervals`): no torch, no I/O.

Outputs are plain dicts of numpy arrays (what crosses the process boundary):
- classification: {"logits": [N, C], "labels": [N] (optional)}
- feature extraction: {"embeddings": [N, D]}
- generation: {"tokens": [N, T] greedy continuations of the prompts (reported, not judged);
  per scored position of W windows of the evaluation text (`collect._window_scores`):
  "top_ids" [W, P, k] (most likely first), "top_logprobs" [W, P, k], "target_logprobs" [W, P]
  (the text's own next token), "windows_digest", "scoring" (how: full logits or an engine's top-k)}

`compare` returns {"metrics": {name: value}, "intervals": {name: [low, high]}, "sample": {unit,
n, per_sample, method}}; `verdict.judge` turns it into pass / warn / fail / cannot tell.

Generation is judged teacher-forced, as llama.cpp's `llama-perplexity --kl-divergence` judges a
quantization: both models read the same text, and at every scored position the candidate's
next-token distribution is compared with the reference's:
- mean_kl: KL(reference || candidate) per position, averaged; p99_kl its 99th percentile.
  Computed over the ids in BOTH models' top-k lists plus one bucket for all other ids (the
  reference keeps its top-k, not 49k logits per position; an engine such as vLLM returns only
  its top-k). Merging ids into one bucket never raises a KL divergence (the log-sum
  inequality), so this is a lower bound of the full KL: on SmolLM2 with k=64 it was 83-85% of
  the full KL for Q8_0 and for RMSNorm weights scaled by 1.05, 75% for a Q4_0 requantization
  (the further apart, the fewer ids both lists share). The lines of `verdict` are for this
  figure.
- top1_agreement: share of positions whose most likely next token is the same.
- perplexity_ratio: perplexity of the candidate over the reference's on the same positions.
The greedy agreements stay as reported figures: a greedy continuation flips for good at the
first near-tie, so sixteen of them swing by ~0.1 between plans of the same weight error.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from accelab.quality.intervals import Interval, bootstrap, mean_interval, wilson

Figures = dict[str, Any]  # {"metrics", "intervals", "sample"}


def _figures(values: dict[str, Any], intervals: dict[str, Interval], sample: dict[str, Any]) -> Figures:
    metrics = {**{name: iv.value for name, iv in intervals.items()}, **values}  # the judged figures first
    return {"metrics": metrics, "intervals": {k: iv.as_list() for k, iv in intervals.items()}, "sample": sample}


# -- classifiers -----------------------------------------------------------------------------------
def classification(ref: dict[str, Any], cand: dict[str, Any]) -> Figures:
    a, b = np.asarray(ref["logits"], dtype=np.float64), np.asarray(cand["logits"], dtype=np.float64)
    _same_shape(a, b, "logits")
    agree = a.argmax(-1) == b.argmax(-1)
    k = min(5, a.shape[-1])
    top_a, top_b = np.argsort(-a, axis=-1)[:, :k], np.argsort(-b, axis=-1)[:, :k]
    overlap = np.array([len(set(x) & set(y)) / k for x, y in zip(top_a, top_b)])
    rel = np.linalg.norm(a - b, axis=-1) / np.maximum(np.linalg.norm(a, axis=-1), 1e-12)
    intervals = {"top1_agreement": wilson(int(agree.sum()), len(agree)), "top5_overlap": mean_interval(overlap)}
    values: dict[str, Any] = {"logit_rel_error": float(rel.max())}
    labels = ref.get("labels")
    if labels is not None and len(labels):
        right_a, right_b = a.argmax(-1) == np.asarray(labels), b.argmax(-1) == np.asarray(labels)
        values.update(accuracy_ref=float(right_a.mean()), accuracy=float(right_b.mean()))
        # paired: the same images, so the change is the mean of per-image differences
        intervals["accuracy_change"] = mean_interval(right_b.astype(float) - right_a.astype(float))
    sample = {
        "unit": "images",
        "n": len(agree),
        "per_sample": 1,
        "method": "Wilson score interval (top-1), bootstrap over images (the others)",
        "wilson": ["top1_agreement"],
    }
    return _figures(values, intervals, sample)


# -- encoders --------------------------------------------------------------------------------------
def embeddings(ref: dict[str, Any], cand: dict[str, Any]) -> Figures:
    a, b = np.asarray(ref["embeddings"], dtype=np.float64), np.asarray(cand["embeddings"], dtype=np.float64)
    _same_shape(a, b, "embeddings")
    cos = np.sum(a * b, axis=-1) / np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1), 1e-12)
    values = {"cosine_min": float(cos.min()), "max_abs_diff": float(np.abs(a - b).max())}
    sample = {"unit": "inputs", "n": len(cos), "per_sample": 1, "method": "bootstrap over inputs"}
    return _figures(values, {"cosine_mean": mean_interval(cos)}, sample)


# -- generation ------------------------------------------------------------------------------------
def generation(ref: dict[str, Any], cand: dict[str, Any]) -> Figures:
    values: dict[str, Any] = greedy(ref, cand) if "tokens" in ref and "tokens" in cand else {}
    if "top_ids" not in ref or "top_ids" not in cand:
        return _figures(values, {}, {"unit": "prompts", "n": len(ref.get("tokens", ())), "per_sample": 1})
    if ref.get("windows_digest") != cand.get("windows_digest"):
        raise ValueError(
            "the reference and the candidate scored different text windows (another tokenizer, text or "
            "window size): delete the cached reference and verify again"
        )
    kl = token_kl(ref["top_ids"], ref["top_logprobs"], cand["top_ids"], cand["top_logprobs"])  # [W, P]
    agree = np.asarray(ref["top_ids"])[..., 0] == np.asarray(cand["top_ids"])[..., 0]  # [W, P]
    ref_lp = np.asarray(ref["target_logprobs"], dtype=np.float64)
    cand_lp = np.asarray(cand["target_logprobs"], dtype=np.float64)
    _same_shape(ref_lp, cand_lp, "scored positions")
    log_ratio = mean_interval((ref_lp - cand_lp).mean(axis=1))  # mean ln(ppl_cand / ppl_ref), per window
    intervals = {
        "mean_kl": mean_interval(kl.mean(axis=1)),
        "p99_kl": pooled_percentile(kl, 99),
        "top1_agreement": mean_interval(agree.mean(axis=1)),
        "perplexity_ratio": Interval(
            value=math.exp(log_ratio.value), low=math.exp(log_ratio.low), high=math.exp(log_ratio.high)
        ),
    }
    values.update(perplexity_ref=math.exp(-ref_lp.mean()), perplexity=math.exp(-cand_lp.mean()))
    scoring = {**(ref.get("scoring") or {}), **(cand.get("scoring") or {})}
    w, p = kl.shape
    sample = {
        "unit": "windows",
        "n": w,
        "per_sample": int(scoring.get("windows_per_sample", 1)),
        "positions": w * p,
        "method": "bootstrap over windows",
        "kl_over": kl_label(np.asarray(ref["top_ids"]).shape[-1], np.asarray(cand["top_ids"]).shape[-1], scoring),
        "window": f"{scoring.get('window_tokens', '?')} tokens, the last {p} scored",
    }
    return _figures(values, intervals, sample)


def greedy(ref: dict[str, Any], cand: dict[str, Any]) -> dict[str, Any]:
    """The greedy continuations' agreements (reported; they do not decide the verdict)."""
    a, b = np.asarray(ref["tokens"]), np.asarray(cand["tokens"])
    _same_shape(a, b, "generated tokens")
    equal = a == b
    # first divergence per prompt: index of the first differing token, T when identical
    first = np.where(equal.all(-1), a.shape[-1], np.argmin(equal, axis=-1))
    return {
        "token_agreement": float(equal.mean()),
        "prefix_agreement": float(np.mean(first / a.shape[-1])),  # matching prefix, as a fraction
        "first_divergence_min": int(first.min()) if (first < a.shape[-1]).any() else None,
        "exact_match_rate": float(np.mean(equal.all(-1))),
    }


def token_kl(ref_ids: Any, ref_lp: Any, cand_ids: Any, cand_lp: Any) -> np.ndarray:
    """KL(reference || candidate) per position [W, P], over the buckets: each id in both top-k
    lists ([W, P, k] each, any k per side), and one for every other id."""
    ref_ids, cand_ids = np.asarray(ref_ids), np.asarray(cand_ids)
    ref_lp, cand_lp = np.asarray(ref_lp, dtype=np.float64), np.asarray(cand_lp, dtype=np.float64)
    _same_shape(ref_ids[..., 0], cand_ids[..., 0], "scored positions")
    out = np.empty(ref_ids.shape[:2])
    for w in range(ref_ids.shape[0]):  # one window at a time: [P, k, k] stays small
        shared = ref_ids[w][:, :, None] == cand_ids[w][:, None, :]  # [P, k_ref, k_cand]
        both = shared.any(-1)  # [P, k_ref]: the reference's id is in the candidate's list too
        lq = np.where(shared, cand_lp[w][:, None, :], -np.inf).max(-1)  # candidate's log p at those ids
        lp = ref_lp[w]
        p_rest = np.clip(1 - np.where(both, np.exp(lp), 0).sum(-1), 1e-12, 1)
        q_rest = np.clip(1 - np.where(both, np.exp(lq), 0).sum(-1), 1e-12, 1)
        shared_terms = np.where(both, np.exp(lp) * (lp - np.where(both, lq, 0)), 0).sum(-1)
        out[w] = shared_terms + p_rest * (np.log(p_rest) - np.log(q_rest))
    return out


def pooled_percentile(values: np.ndarray, q: float) -> Interval:
    """The q-th percentile of every position's value [W, P], with the windows bootstrapped whole."""
    flat = values.reshape(-1)
    low, high = bootstrap(values.shape[0], lambda idx: np.percentile(values[idx].reshape(len(idx), -1), q, axis=1))
    return Interval(value=float(np.percentile(flat, q)), low=low, high=high)


def kl_label(k_ref: int, k_cand: int, scoring: dict[str, Any]) -> str:
    """What the KL figures were computed over, for the table."""
    cand = scoring.get("candidate_topk") or f"top-{k_cand}"
    return f"ids in the reference's top-{k_ref} and the candidate's {cand}, plus one bucket for the rest"


def _same_shape(a: np.ndarray, b: np.ndarray, what: str) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{what} differ in shape: reference {a.shape}, candidate {b.shape}")


METRICS: dict[str, Callable[[dict[str, Any], dict[str, Any]], Figures]] = {
    "image-classification": classification,
    "feature-extraction": embeddings,
    "text-generation": generation,
    "image-text-to-text": generation,
}


def compare(task: str, ref: dict[str, Any], cand: dict[str, Any]) -> Figures:
    return METRICS[task](ref, cand)
