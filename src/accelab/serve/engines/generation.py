"""Text generation for the server over a Runnable: chat templates, left-padded batches, one
`generate` call per batch with per-row sampling, per-row stop rules and streamed text.

Each row of a batch has its own max_tokens, stop strings and temperature:
- `_RowTracker` (a StoppingCriteria, called once per decoding step with every row's new
  token) feeds each row's TextStream, hands new text to the row's unit and tells generate
  which rows are done; generate runs until all are (max_new_tokens is the largest request's).
- `_RowSampling` (a LogitsProcessor) applies each row's temperature and top_p; a greedy row
  keeps only its argmax, so greedy and sampled requests share a batch. A batch of greedy rows
  only runs plain greedy search.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from accelab.catalog.facts import max_sequence_length, text_config
from accelab.plan.runtime import input_device, to_device
from accelab.serve.engines.base import (
    Completion,
    GenUnit,
    Prompt,
    SamplingParams,
    check_token_ids,
    fit_prompt,
)
from accelab.serve.images import decode_image
from accelab.serve.textstream import TextStream

log = logging.getLogger(__name__)


class HFGenerationEngine:
    """Serves a causal LM (`text-generation`) or a vision-language model (`image-text-to-text`)."""

    def __init__(self, runnable: Any, *, name: str, max_context: int | None = None):
        self.runnable = runnable
        self.name = name
        self.task = runnable.task
        processor = runnable.processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.processor = processor if self.task == "image-text-to-text" else None
        gen_config = getattr(runnable.model, "generation_config", None)
        self.eos_ids = _eos_ids(gen_config, self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0)
        self.max_context = max_context or max_sequence_length(runnable.model)
        self.vocab_size = _vocab_size(runnable.model)

    # -- preparing (thread pool) ----------------------------------------------------------
    def prepare_chat(self, messages: list[dict[str, Any]]) -> Prompt:
        """messages: [{"role": ..., "content": str | [{"type": "text", "text": ...} |
        {"type": "image", "url": data-URI}]}] (OpenAI's shape, image parts already unwrapped)."""
        images = [part["url"] for m in messages if isinstance(m["content"], list)
                  for part in m["content"] if part["type"] == "image"]
        if images and self.processor is None:
            raise ValueError(f"model {self.name} ({self.task}) does not take images; send text only, or serve "
                             "an image-text-to-text model (e.g. smolvlm-tiny)")
        if self.processor is not None:
            return self._prepare_vision(messages, images)
        flat = [{"role": m["role"], "content": _text_of(m["content"])} for m in messages]
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(flat, add_generation_prompt=True, tokenize=False)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        else:  # a base model: plain "role: text" lines
            text = "".join(f"{m['role']}: {m['content']}\n" for m in flat) + "assistant:"
            ids = self.tokenizer(text)["input_ids"]
        return self._checked(Prompt(ids=tuple(ids), prompt_tokens=len(ids)))

    def prepare_text(self, prompt: str | list[int]) -> Prompt:
        if isinstance(prompt, list):
            check_token_ids(prompt, self.vocab_size, name=self.name)
            ids = list(prompt)
        else:
            ids = self.tokenizer(prompt, truncation=False)["input_ids"]
        if not ids:
            raise ValueError("prompt is empty; send at least one token of text")
        return self._checked(Prompt(ids=tuple(ids), prompt_tokens=len(ids)))

    def _prepare_vision(self, messages: list[dict[str, Any]], urls: list[str]) -> Prompt:
        images = tuple(decode_image(url, where=f"image {i}") for i, url in enumerate(urls))
        template = [{"role": m["role"], "content": _template_parts(m["content"])} for m in messages]
        text = self.processor.apply_chat_template(template, add_generation_prompt=True, tokenize=False)
        encoded = self.processor(text=[text], images=list(images) or None, return_tensors="pt")
        tokens = int(encoded["input_ids"].shape[1])
        if not images:  # text-only chat goes through the plain tokenizer path at batch time
            return self._checked(Prompt(ids=tuple(encoded["input_ids"][0].tolist()), prompt_tokens=tokens))
        return self._checked(Prompt(text=text, images=images, prompt_tokens=tokens))

    def _checked(self, prompt: Prompt) -> Prompt:
        return prompt  # lengths are checked with max_tokens, in `fit`

    def fit(self, prompt: Prompt, max_tokens: int, *, truncate: bool = False) -> Prompt:
        return fit_prompt(prompt, max_tokens, self.max_context, truncate=truncate, name=self.name)

    # -- running (worker thread) ------------------------------------------------------------
    def generate(self, units: list[GenUnit]) -> list[Completion]:
        batch = self._collate(units)
        streams = [TextStream(self.decode, max_tokens=u.params.max_tokens, stop=u.params.stop,
                              eos_ids=self.eos_ids) for u in units]
        tracker = _RowTracker(units, streams)
        from transformers import StoppingCriteriaList

        device = input_device(self.runnable.model, self.runnable.device)
        self.runnable.generate(
            to_device(batch, device),
            max_new_tokens=max(u.params.max_tokens for u in units),
            stopping_criteria=StoppingCriteriaList([tracker]),
            pad_token_id=self.pad_id,
            **_sampling_kwargs([u.params for u in units]),
        )
        return tracker.completions()

    def _collate(self, units: list[GenUnit]) -> dict[str, torch.Tensor]:
        prompts = [u.prompt for u in units]
        if prompts[0].images:  # the batcher keys keep image and text-only prompts apart
            encoded = self.processor(text=[p.text for p in prompts], images=[im for p in prompts for im in p.images],
                                     padding=True, padding_side="left", return_tensors="pt")
            return {k: v for k, v in encoded.items() if isinstance(v, torch.Tensor)}
        # left padding: generate continues from the last column, so real tokens must end there
        width = max(len(p.ids) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p.ids):] = torch.tensor(p.ids, dtype=torch.long)
            mask[row, width - len(p.ids):] = 1
        return {"input_ids": ids, "attention_mask": mask}  # [B, S]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- continuous batching --------------------------------------------------------------------
    def step_engine(self, limits: Any) -> Any:
        """The StepEngine that runs this model for the continuous scheduler (`limits`: its
        SchedulerConfig); Unsupported, with the reason, where the model must run per batch."""
        from accelab.plan.runtime import Unsupported

        if self.processor is not None:
            raise Unsupported("continuous batching does not take images yet: vision-language models run one "
                              "generate call per batch")
        if self.runnable.plan is not None and self.runnable.plan.backend == "llamacpp":  # sequences of one context
            from accelab.serve.engines.llama_steps import LlamaStepEngine

            return LlamaStepEngine(self.runnable.model.engine, max_sequences=limits.max_running,
                                   kv_tokens=limits.kv_tokens, max_step_tokens=limits.max_step_tokens)
        from accelab.serve.engines.ragged import RaggedTorchEngine

        engine = RaggedTorchEngine(self.runnable)
        problem = engine.self_check(list(self.prepare_chat([{"role": "user", "content": "Hello"}]).ids))
        if problem is not None:
            engine.close()
            raise Unsupported(f"the packed continuous steps do not reproduce {self.name}: {problem}")
        return engine

    def warmup(self) -> None:
        unit = GenUnit(prompt=self.prepare_chat([{"role": "user", "content": "Hello"}]),
                       params=SamplingParams(max_tokens=2, temperature=0))
        self.generate([unit])

    def close(self) -> None:
        self.runnable.close()


class _RowTracker:
    """Per-row bookkeeping during one generate call (a StoppingCriteria in all but name: it
    follows the protocol, __call__(input_ids, scores) -> bool tensor [B])."""

    def __init__(self, units: list[GenUnit], streams: list[TextStream]):
        self.units = units
        self.streams = streams
        self.finished_at: list[float | None] = [None] * len(units)

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        tokens = input_ids[:, -1].tolist()  # note: a CPU-GPU sync point, once per step
        now = time.monotonic()
        done = []
        for row, (unit, stream, token) in enumerate(zip(self.units, self.streams, tokens)):
            if stream.finish_reason is None and not unit.cancelled:
                unit.note_token(now)
                step = stream.push(token)
                unit.emit(step.text)
                if step.finished:
                    self.finished_at[row] = now
            done.append(stream.finish_reason is not None or unit.cancelled)
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    def completions(self) -> list[Completion]:
        out = []
        for row, (unit, stream) in enumerate(zip(self.units, self.streams)):
            if stream.finish_reason is None:  # generate stopped on its own (cancelled, max length)
                unit.emit(stream.end().text)
            out.append(Completion(
                text=stream.output, finish_reason=stream.finish_reason or "length",
                prompt_tokens=unit.prompt.prompt_tokens, completion_tokens=stream.tokens,
                first_token_at=unit.first_token_at, finished_at=self.finished_at[row] or time.monotonic(),
            ))
        return out


class _RowSampling:
    """A LogitsProcessor: each row's temperature and top_p; greedy rows keep their argmax only."""

    def __init__(self, params: list[SamplingParams]):
        self.temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        self.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        self.greedy = self.temperature == 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        # scores: [B, V] float32
        device = scores.device
        greedy = self.greedy.to(device)
        temperature = torch.where(greedy, 1.0, self.temperature).to(device)[:, None]
        scores = scores / temperature
        top_p = self.top_p.to(device)[:, None]
        if (top_p < 1).any():
            sorted_scores, order = scores.sort(dim=-1, descending=True)
            probs = sorted_scores.softmax(dim=-1)
            # drop a token when the tokens ranked above it already hold top_p of the mass
            drop_sorted = ((probs.cumsum(dim=-1) - probs) >= top_p) & (top_p < 1)
            drop = drop_sorted.scatter(1, order, drop_sorted)
            scores = scores.masked_fill(drop, float("-inf"))
        if greedy.any():
            keep = torch.zeros_like(scores, dtype=torch.bool)
            keep.scatter_(1, scores.argmax(dim=-1, keepdim=True), True)
            scores = torch.where(greedy[:, None] & ~keep, torch.full_like(scores, float("-inf")), scores)
        return scores


def _sampling_kwargs(params: list[SamplingParams]) -> dict[str, Any]:
    if all(p.greedy for p in params):
        return {"do_sample": False}
    from transformers import LogitsProcessorList

    # generate's own warpers are switched off: _RowSampling does temperature and top_p per row
    return {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
            "logits_processor": LogitsProcessorList([_RowSampling(params)])}


def _text_of(content: str | list[dict[str, Any]]) -> str:
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content if part["type"] == "text")


def _template_parts(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [{"type": "image"} if p["type"] == "image" else {"type": "text", "text": p["text"]} for p in content]


def _eos_ids(gen_config: Any, tokenizer: Any) -> tuple[int, ...]:
    ids: list[int] = []
    configured = getattr(gen_config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.append(configured)
    elif configured:
        ids.extend(configured)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return tuple(ids)


def _vocab_size(model: Any) -> int | None:
    value = getattr(text_config(getattr(model, "config", None)), "vocab_size", None)
    return value if isinstance(value, int) and value > 0 else None
