"""What `predict` does per task: how a list of inputs becomes a batch (`encode`, run in DataLoader
workers) and how a batch on the device becomes one prediction per row (`predict`, main process).

- image-classification: the image processor; softmax over the logits, top-k labels from
  `config.id2label` with their probabilities.
- feature-extraction: the tokenizer (right padded, truncated to --max-length); mean pooling +
  L2 norm (`catalog.embedding.embed`, the all-MiniLM convention).
- text-generation: the chat template (when the tokenizer has one), left padded; greedy decoding
  of --max-new-tokens; the text of the new tokens.
- image-text-to-text: each image with the same --prompt through the processor's chat template;
  greedy decoding as above.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from accelab.catalog.embedding import embed
from accelab.catalog.facts import max_sequence_length
from accelab.predict.config import PredictConfig

Batch = dict[str, torch.Tensor]
Row = dict[str, Any]


class TaskHandler(Protocol):
    def encode(self, inputs: list[Any]) -> Batch: ...

    def predict(self, runnable: Any, batch: Batch) -> list[Row]: ...


class Classify:
    def __init__(self, processor: Any, model_config: Any, top_k: int):
        self.processor = processor
        labels = getattr(model_config, "id2label", None) or {}
        self.labels = {int(k): str(v) for k, v in labels.items()}
        self.top_k = top_k

    def encode(self, inputs: list[Any]) -> Batch:
        return {"pixel_values": self.processor(images=inputs, return_tensors="pt")["pixel_values"]}  # [B, 3, H, W]

    def predict(self, runnable: Any, batch: Batch) -> list[Row]:
        logits = runnable.forward(batch).logits  # [B, classes]
        probs = logits.float().softmax(dim=-1)
        scores, classes = probs.topk(min(self.top_k, probs.shape[-1]), dim=-1)  # [B, k]
        scores, classes = scores.cpu().tolist(), classes.cpu().tolist()  # note: sync point
        return [
            {
                "predictions": [
                    {"label": self.labels.get(c, str(c)), "class_id": c, "score": s}
                    for c, s in zip(row_classes, row_scores)
                ]
            }
            for row_classes, row_scores in zip(classes, scores)
        ]


class Embed:
    def __init__(self, tokenizer: Any, max_length: int):
        self.tokenizer = tokenizer
        self.max_length = max_length

    def encode(self, inputs: list[Any]) -> Batch:
        encoded = self.tokenizer(
            inputs, padding=True, truncation=True, max_length=self.max_length, padding_side="right", return_tensors="pt"
        )
        return dict(encoded)  # input_ids / attention_mask (/ token_type_ids): [B, S]

    def predict(self, runnable: Any, batch: Batch) -> list[Row]:
        vectors = embed(runnable.forward(batch), batch["attention_mask"])  # [B, H]
        return [{"embedding": v} for v in vectors.float().cpu().tolist()]  # note: sync point


class _Generate:
    """Greedy decoding of a left-padded batch; the rows hold the new text only."""

    tokenizer: Any
    max_new_tokens: int

    def predict(self, runnable: Any, batch: Batch) -> list[Row]:
        width = batch["input_ids"].shape[1]
        out = runnable.generate(
            batch, max_new_tokens=self.max_new_tokens, do_sample=False, pad_token_id=self.tokenizer.pad_token_id
        )
        sequences = out if torch.is_tensor(out) else out.sequences
        new = sequences[:, width:].cpu()  # [B, new tokens]; note: sync point
        eos = self.tokenizer.eos_token_id
        rows = []
        for ids in new.tolist():
            used = (
                ids.index(eos) + 1 if eos is not None and eos in ids else len(ids)
            )  # rows that ended early are padded
            rows.append(
                {
                    "generated_text": self.tokenizer.decode(ids[:used], skip_special_tokens=True).strip(),
                    "new_tokens": used,
                }
            )
        return rows


class GenerateText(_Generate):
    def __init__(self, tokenizer: Any, max_new_tokens: int, max_length: int | None):
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.max_length = max_length

    def encode(self, inputs: list[Any]) -> Batch:
        if getattr(self.tokenizer, "chat_template", None):
            texts = [
                self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
                )
                for q in inputs
            ]
            special = False  # the template holds the special tokens already
        else:
            texts, special = list(inputs), True
        truncate = (
            {"truncation": True, "max_length": self.max_length, "truncation_side": "left"} if self.max_length else {}
        )
        encoded = self.tokenizer(
            texts, padding=True, padding_side="left", add_special_tokens=special, return_tensors="pt", **truncate
        )
        return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}  # [B, S]


class GenerateFromImage(_Generate):
    def __init__(self, processor: Any, prompt: str, max_new_tokens: int):
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.max_new_tokens = max_new_tokens
        conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
        self.text = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)

    def encode(self, inputs: list[Any]) -> Batch:
        encoded = self.processor(
            images=inputs, text=[self.text] * len(inputs), padding=True, padding_side="left", return_tensors="pt"
        )
        return {k: v for k, v in encoded.items() if isinstance(v, torch.Tensor)}


def _max_length(config: PredictConfig, model: Any) -> int:
    limit = max_sequence_length(model)
    if config.max_length is not None:
        if limit is not None and config.max_length > limit:
            raise ValueError(
                f"--max-length {config.max_length} is more than the model takes ({limit} tokens); "
                f"pass --max-length {limit} or less"
            )
        return config.max_length
    return limit or 512


BUILDERS: dict[str, Callable[[PredictConfig, Any], TaskHandler]] = {
    "image-classification": lambda c, r: Classify(r.processor, r.model.config, c.top_k),
    "feature-extraction": lambda c, r: Embed(r.processor, _max_length(c, r.model)),
    "text-generation": lambda c, r: GenerateText(r.processor, c.max_new_tokens, c.max_length),
    "image-text-to-text": lambda c, r: GenerateFromImage(r.processor, c.prompt, c.max_new_tokens),
}


def make_handler(config: PredictConfig, runnable: Any) -> TaskHandler:
    return BUILDERS[config.task](config, runnable)
