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
from accelab.catalog.facts import max_sequence_length
from accelab.catalog.store import read_meta
from accelab.plan.runtime import Runnable, input_device, to_device
from accelab.plan.techniques.memory_format import prepare_batch

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class QualityConfig:
    samples: int = 16  # inputs compared: images, sentences or prompts
    new_tokens: int = 16  # greedy tokens per prompt (generation)
    batch_size: int = 8
    perplexity_tokens: int = 2048  # held-out tokens scored for perplexity (generation); 0 skips it


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
    from accelab.scenarios.generate import generate_once

    loaded = inputs_view(runnable)
    rows = []
    for idx in _batches(config.samples, config.batch_size):
        batch = inputs.generate_batch(loaded, len(idx), offset=idx.start)
        batch = to_device(batch, _device(runnable))
        output, _, _ = generate_once(runnable, batch, config.new_tokens)
        rows.append(output[:, batch["input_ids"].shape[1] :].cpu().numpy())
    out: dict[str, Any] = {"tokens": np.concatenate(rows)}
    if runnable.task == "text-generation" and config.perplexity_tokens:
        out["nll"], out["nll_tokens"] = _heldout_nll(runnable, config.perplexity_tokens)
    return out


def _heldout_nll(runnable: Runnable, max_tokens: int) -> tuple[float, int]:
    """Mean negative log-likelihood per token of the held-out text, in non-overlapping windows."""
    tokenizer = runnable.processor
    ids = tokenizer(inputs.heldout_text(), return_tensors="pt").input_ids[0][:max_tokens]
    window = min(512, max_sequence_length(runnable.model) or 512)
    total, count = 0.0, 0
    summed_nll = getattr(runnable.model, "summed_nll", None)  # runtimes that score without logits (vLLM)
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window].unsqueeze(0).to(_device(runnable))
        if chunk.shape[1] < 2:
            break
        if summed_nll is not None:
            total += float(summed_nll(chunk[0]))
            count += chunk.shape[1] - 1
            continue
        with torch.inference_mode(), runnable.context():
            logits = runnable.model(input_ids=chunk).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], chunk[0, 1:], reduction="sum")
        total += float(loss)
        count += chunk.shape[1] - 1
    return total / count, count


def _layout(batch: dict[str, Any], runnable: Runnable) -> dict[str, Any]:
    return prepare_batch(batch, runnable.plan)


def inputs_view(runnable: Runnable) -> Any:
    return runnable.as_loaded()
