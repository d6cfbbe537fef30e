"""The model the scenarios call when an engine process generates (vLLM's, OpenVINO GenAI's).

A batch of B prompts is B requests submitted together (the engine schedules them into its
steps); a "step" is complete when every unfinished row has its next token, and only then are the
stopping criteria called, once, as transformers calls them (the bench's TokenClock times TTFT,
TPOT, ITL). Greedy decoding is the engine's argmax; `min_new_tokens` is its min_tokens (no end of
sequence before it), so min == max decodes exactly that many tokens. `score_top` (and
`summed_nll`) are the log-probabilities the engine computes in the plan's precision (the quality
guard's teacher-forced scores), not torch's.
"""

from __future__ import annotations

import queue
from pathlib import Path
from typing import Any

import torch

from accelab.backends import engine_wire as W
from accelab.catalog.load import load_processor
from accelab.catalog.spec import ModelSpec
from accelab.plan.plan import Plan
from accelab.plan.runtime import Runnable, Unsupported


def check_checkpoint(spec: ModelSpec, *, backend: str, verb: str) -> None:
    """Unsupported unless `spec` is a checkpoint in the Hugging Face layout (config.json and
    weights), which an engine process loads (`verb`: what the backend does with it)."""
    if spec.custom:
        raise Unsupported(
            f"backend {backend} {verb} checkpoints in the Hugging Face layout; {spec.name} is a custom "
            "nn.Module built by code (save it with save_pretrained, or use backend torch)"
        )
    source = Path(spec.source)
    has_config = (source / "config.json").is_file()
    if not has_config or not [*source.glob("*.safetensors"), *source.glob("*.bin")]:
        raise Unsupported(
            f"backend {backend} {verb} a directory with config.json and weights; {source} has "
            f"{'no weights' if has_config else 'no config.json'} (a GGUF-only model runs on backend llamacpp)"
        )


def engine_runnable(
    client: Any, spec: ModelSpec, plan: Plan, device: torch.device, *, notes: list[str], weight_bytes: int | None
) -> Runnable:
    """The Runnable over a connected engine client: the tokenizer and config stay on accelab's side
    (the batch builders and the server read them); the client closes with the Runnable."""
    from transformers import AutoConfig, GenerationConfig

    try:
        processor = load_processor(spec)
        config = AutoConfig.from_pretrained(spec.source)
        try:
            generation = GenerationConfig.from_pretrained(spec.source)
        except OSError:
            generation = None
    except BaseException:
        client.close()
        raise
    model = EngineModel(client, config, generation, backend=plan.backend)
    runnable = Runnable(
        model=model,
        processor=processor,
        device=device,
        task=spec.task,
        generate_fn=model.generate,
        weight_bytes=weight_bytes,
        spec=spec,
        plan=plan,
        worker_pids=(client.info.pid,),
        notes=[
            *notes,
            f"memory figures are accelab's measuring process; the {client.info.runtime} engine process "
            "holds the weights and KV cache",
        ],
    )
    runnable.exit_stack.callback(client.close)
    return runnable


# -- the model accelab's scenarios call ------------------------------------------------------------
class EngineModel:
    """Generation and scoring on an engine process, shaped like what the scenarios call on a torch
    model: `config` and `generation_config` for the batch builders and the server, `generate` for
    the Runnable, `summed_nll` for the perplexity. `backend`: the plan's, for the messages."""

    def __init__(self, client: Any, config: Any, generation_config: Any, *, backend: str = "vllm"):
        self.client = client
        self.backend = backend
        self.config = config
        self.generation_config = generation_config

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"backend {self.backend} returns tokens and log-probabilities, not logits: use generate(), or "
            "summed_nll() for a perplexity"
        )

    def summed_nll(self, ids: torch.Tensor) -> float:
        """The negative log-likelihood of ids[1:] given what precedes each token, summed (ids: [S])."""
        return -sum(self.client.score([int(t) for t in ids]))

    def score_top(self, ids: list[int], top_k: int) -> W.Scored:
        """The engine's log-probabilities of ids[1:], and its top_k at each of those positions (the
        quality guard's teacher-forced windows, `quality.windows`)."""
        scored = self.client.score_top(ids, top_k)
        if len(scored.top_ids) != len(ids) - 1:
            raise RuntimeError(
                f"the {self.backend} engine returned top log-probabilities for {len(scored.top_ids)} positions of "
                f"{len(ids) - 1}: an engine process older than this accelab? (restart it)"
            )
        return scored

    def generate(
        self,
        batch: dict[str, torch.Tensor],
        max_new_tokens: int,
        min_new_tokens: int | None = None,
        do_sample: bool = False,
        stopping_criteria: Any = None,
        pad_token_id: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        **unsupported: Any,
    ) -> torch.Tensor:
        """Decode every row; returns [B, prompt + new] like transformers' generate (finished rows are
        padded with pad_token_id)."""
        if unsupported.get("logits_processor"):
            raise ValueError(f"backend {self.backend} samples in its engine: a logits_processor cannot run there")
        ids = batch["input_ids"].cpu()
        mask = batch.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask.cpu()
        prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]  # left padding removed
        width = ids.shape[1]
        pad = pad_token_id if pad_token_id is not None else (self.config.eos_token_id or 0)
        if isinstance(pad, list):
            pad = pad[0]
        out = torch.full((len(prompts), width + max_new_tokens), pad, dtype=torch.long)  # [B, prompt + new]
        out[:, :width] = ids
        rows = _Rows(
            self.client,
            prompts,
            max_new_tokens,
            min_new_tokens or 0,
            temperature=(temperature if temperature is not None else 1.0) if do_sample else 0.0,
            top_p=top_p if do_sample and top_p is not None else 1.0,
        )
        try:
            end = rows.run(out, width, list(stopping_criteria or []))
        finally:
            rows.abort_unfinished()
        return out[:, :end]


class _Rows:
    """One generate call: B requests in flight, their tokens gathered into steps."""

    def __init__(
        self, client: Any, prompts: list[list[int]], max_new: int, min_new: int, *, temperature: float, top_p: float
    ):
        self.client = client
        self.events: queue.Queue = queue.Queue()  # (row, message), from the reader thread
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.finished = [False] * len(prompts)
        self.ids = [client.new_id() for _ in prompts]
        for row, prompt in enumerate(prompts):
            client.submit(
                W.Submit(
                    id=self.ids[row],
                    prompt_ids=prompt,
                    max_tokens=max_new,
                    min_tokens=min_new,
                    temperature=temperature,
                    top_p=top_p,
                ),
                lambda message, row=row: self.events.put((row, message)),
            )
        self.max_new = max_new

    def run(self, out: torch.Tensor, width: int, criteria: list[Any]) -> int:
        """Fill `out` step by step; the end column of what was generated."""
        for step in range(self.max_new):
            self._wait_for_step(step)
            live = [r for r in range(len(self.tokens)) if len(self.tokens[r]) > step]
            if not live:
                return width + step
            for r in live:
                out[r, width + step] = self.tokens[r][step]
            if _stop(criteria, out[:, : width + step + 1]):
                return width + step + 1
        return width + self.max_new

    def _wait_for_step(self, step: int) -> None:
        """Until every row has token `step` or has finished without it."""
        while any(not self.finished[r] and len(self.tokens[r]) <= step for r in range(len(self.tokens))):
            row, message = self.events.get()
            if isinstance(message, W.Failed):
                self.finished[row] = True
                raise RuntimeError(f"the {self.client.name} failed on row {row} of the batch: {message.error}")
            self.tokens[row].extend(message.tokens)
            if message.finished is not None:
                self.finished[row] = True

    def abort_unfinished(self) -> None:
        for row, done in enumerate(self.finished):
            if not done:
                self.client.abort(self.ids[row])


def _stop(criteria: list[Any], input_ids: torch.Tensor) -> bool:
    """Call every criterion once (each must see every step); stop when one says all rows are done."""
    stop = False
    for criterion in criteria:
        stop |= bool(torch.as_tensor(criterion(input_ids, None)).all())
    return stop
