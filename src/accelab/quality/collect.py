"""Collect a model's outputs on the real sample inputs (runs in the measuring child).

The same function collects the fp32 eager reference and every candidate plan, so both see
byte-identical inputs. What it returns crosses a process boundary: numpy arrays and floats.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from accelab.catalog import inputs
from accelab.catalog.embedding import embed
from accelab.catalog.store import read_meta
from accelab.plan.runtime import Runnable, input_device, to_device
from accelab.plan.techniques.memory_format import prepare_batch
from accelab.quality import windows

log = logging.getLogger(__name__)


# inputs compared by default per task: enough for an interval that can clear the lines (a
# classifier's 16 of 16 agreeing images only show top-1 >= 0.81; 128 of 128 show >= 0.97)
DEFAULT_SAMPLES = {
    "image-classification": 128,
    "feature-extraction": 32,
    "text-generation": 16,
    "image-text-to-text": 16,
}
# a tune checks every candidate: generation at 8 samples (16 windows, 2,048 tokens, no greedy
# continuations) keeps that check no longer than it was (8 prompts and 2,048 perplexity tokens);
# its intervals are ~1.4x verify's; the other tasks as verify
TUNE_SAMPLES = {**DEFAULT_SAMPLES, "text-generation": 8, "image-text-to-text": 8}


@dataclass(frozen=True, kw_only=True, slots=True)
class QualityConfig:
    samples: int = 16  # inputs compared: images, sentences or prompts (see DEFAULT_SAMPLES)
    new_tokens: int = 16  # greedy tokens per prompt (generation; reported, not judged); 0 skips them
    batch_size: int = 8
    # generation: windows of the evaluation text scored teacher-forced (quality.windows); 2 per
    # sample, so --samples 16 forwards 32 windows of 128 tokens (4,096 tokens, 3,072 scored; the
    # greedy-era verify scored 2,048 for its perplexity): SmolLM2's bf16 verify took 1.5x its
    # earlier time, and its mean-KL interval there is +-4% of the estimate
    windows_per_sample: int = 2
    window_tokens: int = 128
    context_tokens: int = 32  # the first tokens of a window are context only, not scored
    top_k: int = 64  # log-probabilities kept per scored position (the KL's buckets; 64: ~85% of the full KL)

    def __post_init__(self) -> None:
        for name in ("samples", "batch_size", "windows_per_sample", "top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"QualityConfig {name}={getattr(self, name)} must be 1 or more")
        if self.new_tokens < 0:
            raise ValueError(f"QualityConfig new_tokens={self.new_tokens} must be 0 (no greedy continuations) or more")
        if not 1 <= self.context_tokens < self.window_tokens:
            raise ValueError(
                f"QualityConfig context_tokens={self.context_tokens} must be 1 to window_tokens - 1 "
                f"({self.window_tokens - 1}): a window needs positions to score"
            )

    @property
    def windows(self) -> int:
        return self.samples * self.windows_per_sample


def config_for(task: str, samples: int | None = None, *, tune: bool = False, **fields: Any) -> QualityConfig:
    """The quality guard's configuration for a task: `samples` None takes DEFAULT_SAMPLES (a
    tune's check: TUNE_SAMPLES)."""
    defaults = TUNE_SAMPLES if tune else DEFAULT_SAMPLES
    return QualityConfig(samples=samples or defaults.get(task, 16), **fields)


def collect(runnable: Runnable, config: QualityConfig) -> dict[str, Any]:
    if runnable.task == "feature-extraction" and runnable.spec is not None and runnable.spec.custom:
        return _custom_embeddings(runnable, config)
    collectors = {
        "image-classification": _classification,
        "feature-extraction": _embeddings,
        "text-generation": _generation,
        "image-text-to-text": _generation,
    }
    return collectors[runnable.task](runnable, config)


def _batches(n: int, size: int) -> list[range]:
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


def _device(runnable: Runnable) -> torch.device:
    return input_device(runnable.model, runnable.device)


def _classification(runnable: Runnable, config: QualityConfig) -> dict[str, Any]:
    images, labels = _labelled_images(runnable, config.samples)
    logits = []
    for idx in _batches(len(images), config.batch_size):
        batch = runnable.processor(images=[images[i] for i in idx], return_tensors="pt")
        batch = _layout(to_device(dict(batch), _device(runnable)), runnable)
        logits.append(runnable.forward(batch).logits.float().cpu().numpy())
    out: dict[str, Any] = {"logits": np.concatenate(logits)}
    if labels is not None:
        out["labels"] = np.asarray(labels)
    return out


def _labelled_images(runnable: Runnable, n: int) -> tuple[list[Any], list[int] | None]:
    """A model trained on digits is checked on the digits test split, with its labels;
    any other classifier on the real photos (no labels: agreement only)."""
    meta = read_meta(Path(runnable.spec.source)) or {}
    if meta.get("dataset") == "digits":
        images, labels = inputs.digits("test", image_size=int(meta.get("image_size", 32)))
        return images[:n], labels[:n]
    return inputs.photos(n), None


def _embeddings(runnable: Runnable, config: QualityConfig) -> dict[str, Any]:
    sentences = inputs.sentences(config.samples)
    vectors = []
    for idx in _batches(len(sentences), config.batch_size):
        batch = runnable.processor([sentences[i] for i in idx], padding=True, truncation=True, return_tensors="pt")
        batch = to_device(dict(batch), _device(runnable))
        output = runnable.forward(batch)
        vectors.append(embed(output, batch["attention_mask"]).float().cpu().numpy())
    return {"embeddings": np.concatenate(vectors)}


def _custom_embeddings(runnable: Runnable, config: QualityConfig) -> dict[str, Any]:
    """A custom model's outputs on seeded rows shaped like its example inputs (it has no text)."""
    rows = runnable.processor.random_rows(config.samples)
    vectors = []
    for idx in _batches(config.samples, config.batch_size):
        batch = to_device({k: v[idx.start : idx.stop] for k, v in rows.items()}, _device(runnable))
        out = runnable.forward(batch).logits.float()
        vectors.append(out.reshape(out.shape[0], -1).cpu().numpy())
    return {"embeddings": np.concatenate(vectors)}


def _generation(runnable: Runnable, config: QualityConfig) -> dict[str, Any]:
    """Greedy continuations of the prompts (reported), and the teacher-forced scores of the
    evaluation text's windows (judged: `quality.windows`, `metrics.generation`)."""
    from accelab.scenarios.generate import generate_once

    loaded = inputs_view(runnable)
    rows = []
    for idx in _batches(config.samples if config.new_tokens else 0, config.batch_size):
        batch = inputs.generate_batch(loaded, len(idx), offset=idx.start)
        batch = to_device(batch, _device(runnable))
        output, _, _ = generate_once(runnable, batch, config.new_tokens)
        rows.append(output[:, batch["input_ids"].shape[1] :].cpu().numpy())
    tokenizer = getattr(runnable.processor, "tokenizer", runnable.processor)  # a VLM's processor holds one
    chosen = windows.text_windows(tokenizer, config.windows, config.window_tokens)
    scores = windows.score_windows(
        runnable, chosen, context_tokens=config.context_tokens, top_k=config.top_k, batch_size=config.batch_size
    )
    greedy = {"tokens": np.concatenate(rows)} if rows else {}
    return {
        **greedy,
        "top_ids": scores["top_ids"],
        "top_logprobs": scores["top_logprobs"],
        "target_logprobs": scores["target_logprobs"],
        "windows_digest": windows.digest(chosen, config.context_tokens),
        "scoring": {
            "window_tokens": config.window_tokens,
            "context_tokens": config.context_tokens,
            "windows_per_sample": config.windows_per_sample,
            "candidate_topk": scores["candidate_topk"],
        },
    }


def _layout(batch: dict[str, Any], runnable: Runnable) -> dict[str, Any]:
    return prepare_batch(batch, runnable.plan)


def inputs_view(runnable: Runnable) -> Any:
    return runnable.as_loaded()
