"""Text generation for the server over a Runnable: chat templates, left-padded batches, one
`generate` call per batch with per-row sampling, per-row stop rules and streamed text (each row
has its own max_tokens, stop strings and temperature: `engines.batch_rows`), and the step engine
of continuous batching. Echo's prompt log-probabilities come from one forward of each prompt that
asks for them; n > 1 choices run as rows of their own here (the continuous scheduler shares the
prompt's KV).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from accelab.catalog.facts import max_sequence_length, text_config
from accelab.plan.runtime import Unsupported, input_device, to_device
from accelab.runtimes import StepKind, WorkerKind
from accelab.serve.engines.base import (
    Completion,
    GenUnit,
    PayloadTooLarge,
    Prompt,
    SamplingParams,
    StepEngine,
    check_token_ids,
    fit_prompt,
)
from accelab.serve.engines.batch_rows import RowTracker, sampling_kwargs
from accelab.serve.images import ImagePolicy, check_image, decode_image
from accelab.serve.runner.logprobs import prompt_logprobs
from accelab.serve.runner.ragged import RaggedTorchEngine
from accelab.serve.runner.sampling import SampledToken, SequenceSampler
from accelab.serve.runner.vision import split_images
from accelab.serve.scheduler import SchedulerConfig
from accelab.serve.stops import StopRules
from accelab.serve.textstream import stream_for

log = logging.getLogger(__name__)


class HFGenerationEngine:
    """Serves a causal LM (`text-generation`) or a vision-language model (`image-text-to-text`)."""

    def __init__(
        self,
        runnable: Any,
        *,
        name: str,
        max_context: int | None = None,
        steps: StepKind | None = "torch",
        worker: WorkerKind = "continuous",
    ):
        self.runnable = runnable
        self.name = name
        self.steps = steps  # the step engine of continuous batching (accelab.runtimes.serve_path)
        self.worker = worker
        self.image_policy = ImagePolicy()  # the server sets its own (accelab.serve.state)
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
        self._template_tools: bool | None = None  # the chat template writes tools itself (probed once)

    @property
    def device(self) -> str:
        return str(self.runnable.device)

    # -- preparing (thread pool) ----------------------------------------------------------
    def prepare_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> Prompt:
        """messages: [{"role": ..., "content": str | [{"type": "text", "text": ...} |
        {"type": "image", "url": data-URI}], maybe "tool_calls"}] (OpenAI's shape, image parts
        already unwrapped); `tools`: OpenAI tool specs (see `accelab.serve.tools`)."""
        images = [
            part["url"]
            for m in messages
            if isinstance(m["content"], list)
            for part in m["content"]
            if part["type"] == "image"
        ]
        if images and self.processor is None:
            raise ValueError(
                f"model {self.name} ({self.task}) does not take images; send text only, or serve "
                "an image-text-to-text model (e.g. smolvlm-tiny)"
            )
        if self.processor is not None:
            if tools or any(m.get("tool_calls") for m in messages):
                from accelab.serve import tools as tool_format

                # a vision template writes role and content only: the tools go into the system message
                messages = tool_format.messages_without_tool_format(messages, tools)
            return self._prepare_vision(messages, images)
        flat = [{**m, "content": _text_of(m["content"])} for m in messages]
        extra: dict[str, Any] = {}
        if tools or any(m.get("tool_calls") for m in flat):
            flat, extra = self._with_tools(flat, tools)
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(flat, add_generation_prompt=True, tokenize=False, **extra)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        else:  # a base model: plain "role: text" lines
            text = "".join(f"{m['role']}: {m['content']}\n" for m in flat) + "assistant:"
            ids = self.tokenizer(text)["input_ids"]
        return self._checked(Prompt(ids=tuple(ids), prompt_tokens=len(ids)))

    def _with_tools(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The messages (and template arguments) that put the tools and earlier calls in the prompt."""
        from accelab.serve import tools as tool_format

        if self._template_tools is None:
            self._template_tools = tool_format.template_renders_tools(self.tokenizer)
        if self._template_tools:
            return tool_format.messages_for_template(messages), ({"tools": tools} if tools else {})
        return tool_format.messages_without_tool_format(messages, tools), {}

    def prepare_text(self, prompt: str | list[int]) -> Prompt:
        if isinstance(prompt, list):
            check_token_ids(prompt, self.vocab_size, name=self.name)
            ids = list(prompt)
        else:
            ids = self.tokenizer(prompt, truncation=False)["input_ids"]
        if not ids:
            raise ValueError("prompt is empty; send at least one token of text")
        return self._checked(Prompt(ids=tuple(ids), prompt_tokens=len(ids)))

    def _prepare_vision(self, messages: list[dict[str, Any]], urls: list[str | bytes]) -> Prompt:
        assert self.processor is not None, "images reach a vision-language model only"
        policy = self.image_policy
        if len(urls) > policy.max_images:
            raise PayloadTooLarge(
                f"{len(urls)} images in one request; this server takes at most {policy.max_images} "
                "(--max-images): send fewer"
            )
        images = tuple(decode_image(url, where=f"image {i}", policy=policy) for i, url in enumerate(urls))
        return self._checked(self._vision_prompt(messages, images))

    def _vision_prompt(self, messages: list[dict[str, Any]], images: tuple[Any, ...]) -> Prompt:
        """The processor's one pass over the chat and its images: the expanded token ids, and
        each image's encoder inputs and placeholder positions for the continuous steps."""
        prompt, _ = self._vision_encoded(messages, images)
        return prompt

    def _vision_encoded(self, messages: list[dict[str, Any]], images: tuple[Any, ...]) -> tuple[Prompt, dict[str, Any]]:
        assert self.processor is not None, "images reach a vision-language model only"
        template = [{"role": m["role"], "content": _template_parts(m["content"])} for m in messages]
        text = self.processor.apply_chat_template(template, add_generation_prompt=True, tokenize=False)
        encoded = self.processor(text=[text], images=list(images) or None, return_tensors="pt")
        ids = tuple(encoded["input_ids"][0].tolist())
        if not images:  # text-only chat goes through the plain tokenizer path at batch time
            return Prompt(ids=ids, prompt_tokens=len(ids)), encoded
        media = split_images(self.runnable.model, encoded, ids, len(images))
        return Prompt(ids=ids, text=text, images=images, media=media, prompt_tokens=len(ids)), encoded

    def _checked(self, prompt: Prompt) -> Prompt:
        return prompt  # lengths are checked with max_tokens, in `fit`

    def fit(self, prompt: Prompt, max_tokens: int, *, truncate: bool = False) -> Prompt:
        return fit_prompt(prompt, max_tokens, self.max_context, truncate=truncate, name=self.name)

    # -- running (worker thread) ------------------------------------------------------------
    def generate(self, units: list[GenUnit]) -> list[Completion]:
        batch = self._collate(units)
        streams = [stream_for(u.params, self.decode) for u in units]
        samplers = [u.sampler or self._sequence_sampler(u.params, u.prompt) for u in units]
        for unit in units:
            if unit.prompt_sampled is None:
                unit.prompt_sampled = self._prompt_logprobs(unit)
        rules = [StopRules.of(u.params, self.eos_ids) for u in units]
        tracker = RowTracker(units, streams, rules, decode=self.decode)
        from transformers import StoppingCriteriaList

        device = input_device(self.runnable.model, self.runnable.device)
        self.runnable.generate(
            to_device(batch, device),
            max_new_tokens=max(u.params.max_tokens for u in units),
            stopping_criteria=StoppingCriteriaList([tracker]),
            pad_token_id=self.pad_id,
            **sampling_kwargs(samplers, tracker),
        )
        return tracker.completions()

    def sampler(self, params: SamplingParams, prompt: Prompt, *, grammar: Any = None, seed_offset: int = 0) -> object:
        """What the routes attach to a unit (GenUnit.sampler) for this engine's steps to sample
        with: here the sequence's SequenceSampler (`grammar`: a structured.Matcher)."""
        return self._sequence_sampler(params, prompt, grammar=grammar, seed_offset=seed_offset)

    def _sequence_sampler(
        self, params: SamplingParams, prompt: Prompt, *, grammar: Any = None, seed_offset: int = 0
    ) -> SequenceSampler:
        return SequenceSampler(
            params, prompt=prompt.ids, eos_ids=self.eos_ids, grammar=grammar, seed_offset=seed_offset
        )

    def grammar_tokenizer(self) -> Any:
        """The tokenizer as llguidance sees it (built once), for structured outputs."""
        from accelab.serve.structured import llg_tokenizer

        return llg_tokenizer(self.tokenizer, self.eos_ids[0] if self.eos_ids else None)

    def _prompt_logprobs(self, unit: GenUnit) -> list[SampledToken | None] | None:
        top = unit.params.prompt_logprobs
        if top is None:
            return None
        if not unit.prompt.ids or unit.prompt.images:
            raise ValueError("prompt log-probabilities (echo with logprobs) need a text prompt, not images")
        ids = torch.tensor(
            [unit.prompt.ids], dtype=torch.long, device=input_device(self.runnable.model, self.runnable.device)
        )
        with torch.inference_mode(), self.runnable.context():
            logits = self.runnable.model(input_ids=ids).logits[0]  # [L, V]
        return prompt_logprobs(logits, unit.prompt.ids, top)

    def _collate(self, units: list[GenUnit]) -> dict[str, torch.Tensor]:
        prompts = [u.prompt for u in units]
        if prompts[0].images:  # the batcher keys keep image and text-only prompts apart
            assert self.processor is not None, "images reach a vision-language model only"
            encoded = self.processor(
                text=[p.text for p in prompts],
                images=[im for p in prompts for im in p.images],
                padding=True,
                padding_side="left",
                return_tensors="pt",
            )
            return {k: v for k, v in encoded.items() if isinstance(v, torch.Tensor)}
        # left padding: generate continues from the last column, so real tokens must end there
        width = max(len(p.ids) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p.ids) :] = torch.tensor(p.ids, dtype=torch.long)
            mask[row, width - len(p.ids) :] = 1
        return {"input_ids": ids, "attention_mask": mask}  # [B, S]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- continuous batching --------------------------------------------------------------------
    def step_engine(self, limits: SchedulerConfig) -> StepEngine:
        """The StepEngine that runs this model for the continuous scheduler; Unsupported, with
        the reason, where the model must run per batch."""
        if self.steps is None:
            backend = self.runnable.plan.backend if self.runnable.plan is not None else "this runtime"
            raise Unsupported(f"backend {backend} has no step engine for continuous batching")
        if self.steps == "llamacpp":  # sequences of one context
            from accelab.serve.runner.llama_steps import LlamaStepEngine

            return LlamaStepEngine(
                self.runnable.model.engine,
                max_sequences=limits.max_running,
                kv_tokens=limits.kv_tokens,
                max_step_tokens=limits.max_step_tokens,
            )

        if self.processor is not None and self.steps != "torch":
            raise Unsupported(f"the {self.steps} step engine takes no images: vision-language models run per batch")
        if self.processor is not None:  # the check runs an image prompt: the encoder's features in the steps
            engine = RaggedTorchEngine(self.runnable, limits)
            check, encoded = self._vision_encoded(_CHECK_CHAT, (check_image(),))
            reference = {k: v for k, v in encoded.items() if k not in ("input_ids", "attention_mask")}
            problem = engine.self_check(list(check.ids), check.media, reference)
        else:  # the steps take the weights over as they pack them: held once, even while loading
            prompt = list(self.prepare_chat([{"role": "user", "content": "Hello"}]).ids)
            engine = RaggedTorchEngine(self.runnable, limits, take_over=prompt)
            problem = engine.self_check(prompt)
        if problem is not None and engine.handed_over:
            engine.close()
            raise RuntimeError(
                f"the packed continuous steps do not reproduce {self.name} ({problem}), and they took its weights "
                "over: serve it with --scheduler static (the model's own forward, one generate call per batch)"
            )
        if problem is not None:
            engine.close()
            raise Unsupported(f"the packed continuous steps do not reproduce {self.name}: {problem}")
        engine.hand_over_weights()  # a compiled plan's: its graphs read the weights as they were built
        if engine.handed_over:
            log.info(
                "the steps hold the model's Linear weights in their own layout (%.2f GB); the model's own copies "
                "were released",
                engine.handed_over / 1e9,
            )
        return engine

    def warmup(self) -> None:
        unit = GenUnit(
            prompt=self.prepare_chat([{"role": "user", "content": "Hello"}]),
            params=SamplingParams(max_tokens=2, temperature=0),
        )
        self.generate([unit])

    def close(self) -> None:
        self.runnable.close()


_CHECK_CHAT = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in it?"}]}]


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
