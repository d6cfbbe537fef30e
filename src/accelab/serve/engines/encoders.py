"""Embeddings (feature-extraction) and image classification over a Runnable: forward passes
over whole batches (embeddings in length-sorted sub-batches, see `embed`)."""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image

from accelab.catalog.embedding import embed
from accelab.catalog.facts import max_sequence_length
from accelab.plan.runtime import input_device, to_device
from accelab.runtimes import WorkerKind
from accelab.serve.engines.base import ContextTooLong, ImageInput, Label, TextInput, check_token_ids
from accelab.serve.images import ImagePolicy, decode_image, encode_png

SUB_BATCH = 16


class HFEmbeddingEngine:
    """Sentence embeddings: mean over real tokens, then L2 normalisation (catalog.embedding)."""

    worker: WorkerKind = "batches"

    def __init__(self, runnable: Any, *, name: str, max_tokens: int | None = None):
        self.runnable = runnable
        self.name = name
        self.task = runnable.task
        self.tokenizer = runnable.processor
        config = getattr(runnable.model, "config", None)
        # the longest input it was trained on: the tokenizer's truncation length bounds the positions
        self.max_tokens = max_tokens or max_sequence_length(config, self.tokenizer) or 512
        self.vocab_size = getattr(config, "vocab_size", None)
        self.pad_id = self.tokenizer.pad_token_id or 0

    @property
    def device(self) -> str:
        return str(self.runnable.device)

    def prepare_text(self, text: str | list[int], *, truncate: bool = False, where: str = "input") -> TextInput:
        """Token ids for one input. Longer than the model's window: ContextTooLong (400), or with
        `truncate` its first window's worth of tokens (the tokenizer keeps the closing token)."""
        if isinstance(text, list):
            check_token_ids(text, self.vocab_size, name=self.name)
            ids = list(text)
        else:  # the tokenizer of a sentence-transformers model truncates silently unless told not to
            ids = self.tokenizer(text, truncation=False)["input_ids"]
        if not ids:
            raise ValueError(f"{where} is empty; send at least one token of text")
        if len(ids) <= self.max_tokens:
            return TextInput(ids=tuple(ids))
        if not truncate:
            raise ContextTooLong(
                f"{where} has {len(ids)} tokens; {self.name} takes at most {self.max_tokens}; "
                'split the text, or send "truncate": true to embed its first '
                f"{self.max_tokens} tokens"
            )
        if isinstance(text, list):
            kept = ids[: self.max_tokens]
        else:
            kept = self.tokenizer(text, truncation=True, max_length=self.max_tokens)["input_ids"]
        return TextInput(ids=tuple(kept), truncated=len(ids) - len(kept))

    def embed(self, units: list[TextInput]) -> list[Any]:
        """Inputs sorted by length run in sub-batches of at most SUB_BATCH, each padded to its
        own longest: fewer padded tokens than one batch padded to the longest of all (on this
        CPU, per-input cost is flat from 16 up, and MiniLM batches of sentences got ~12% faster)."""
        order = sorted(range(len(units)), key=lambda i: units[i].tokens)
        parts = -(-len(units) // SUB_BATCH)  # ceil: sub-batches of nearly equal size
        vectors: list[Any] = [None] * len(units)
        for k in range(parts):
            chunk = order[k * len(order) // parts : (k + 1) * len(order) // parts]
            for i, vector in zip(chunk, self._embed_padded([units[i] for i in chunk])):
                vectors[i] = vector
        return vectors

    def _embed_padded(self, units: list[TextInput]) -> list[list[float]]:
        width = max(u.tokens for u in units)
        ids = torch.full((len(units), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(units), width), dtype=torch.long)
        for row, unit in enumerate(units):  # right padding: the pooling leaves padding out
            ids[row, : unit.tokens] = torch.tensor(unit.ids, dtype=torch.long)
            mask[row, : unit.tokens] = 1
        batch = {"input_ids": ids, "attention_mask": mask}  # [B, S]
        if "token_type_ids" in getattr(self.tokenizer, "model_input_names", ()):  # exported graphs need all inputs
            batch["token_type_ids"] = torch.zeros_like(ids)
        batch = to_device(batch, input_device(self.runnable.model, self.runnable.device))
        output = self.runnable.forward(batch)
        vectors = embed(output, batch["attention_mask"])  # [B, H]
        return list(vectors.float().cpu().numpy())  # float32 rows: base64 answers are their bytes

    def warmup(self) -> None:
        self.embed([self.prepare_text("Hello, world.")])

    def close(self) -> None:
        self.runnable.close()


class HFClassificationEngine:
    """Image classification: the model's image processor, then softmax over its labels."""

    worker: WorkerKind = "batches"

    def __init__(self, runnable: Any, *, name: str):
        self.runnable = runnable
        self.name = name
        self.task = runnable.task
        self.image_processor = runnable.processor
        self.image_policy = ImagePolicy()  # the server sets its own (accelab.serve.state)
        config = getattr(runnable.model, "config", None)
        self.labels: dict[int, str] = dict(getattr(config, "id2label", None) or {})

    @property
    def device(self) -> str:
        return str(self.runnable.device)

    def prepare_image(self, data: str, *, top_k: int = 5, where: str = "image") -> ImageInput:
        image = decode_image(data, where=where, policy=self.image_policy)
        pixels = self.image_processor(images=image, return_tensors="pt")["pixel_values"][0]  # [3, H, W]
        return ImageInput(pixels=pixels, top_k=top_k)

    def classify(self, units: list[ImageInput]) -> list[list[Label]]:
        pixels = torch.stack([u.pixels for u in units])  # [B, 3, H, W]
        batch = to_device({"pixel_values": pixels}, input_device(self.runnable.model, self.runnable.device))
        output = self.runnable.forward(batch)
        logits = output.logits if hasattr(output, "logits") else output[0]
        probs = logits.float().softmax(dim=-1).cpu()  # [B, classes]
        k = min(max(u.top_k for u in units), probs.shape[-1])
        scores, indices = probs.topk(k, dim=-1)
        return [
            [Label(label=self.labels.get(i, str(i)), score=s) for s, i in zip(row_s[: u.top_k], row_i[: u.top_k])]
            for u, row_s, row_i in zip(units, scores.tolist(), indices.tolist())
        ]

    def warmup(self) -> None:
        self.classify([self.prepare_image(encode_png(Image.new("RGB", (32, 32))), top_k=1)])

    def close(self) -> None:
        self.runnable.close()
