"""`accelab serve --plan vllm` (or an OpenVINO plan on a text-generation model): accelab's server
in front of an engine process that schedules its own steps, vLLM's or OpenVINO GenAI's.

accelab's routes, limits, errors, streaming and /metrics stay as for every engine; the prompt is
prepared by `HFGenerationEngine` (chat template, tokenizer, context check) in this process, and the
tokens are made by vLLM's AsyncLLM in accelab's vLLM engine process, which schedules them itself
(`VllmWorker` replaces the continuous worker). Why not front `vllm serve`: its OpenAI layer would
tokenise, detokenise and validate a second time, and accelab's admission control, deadlines and
metrics would sit outside the engine's queue instead of beside it (see docs/runtimes.md, vLLM as a runtime).

The engine process belongs to this server (keep 0): it leaves when the server does. Both engines
speak `engine_wire`; OpenVINO GenAI's sampler has no logit_bias, so that field is a 400 there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from accelab.plan.runtime import Unsupported
from accelab.serve.engines.base import FieldNotSupported
from accelab.serve.engines.generation import HFGenerationEngine
from accelab.serve.engines.vllm_worker import VllmWorker

if TYPE_CHECKING:
    from accelab.serve.config import ServeConfig
    from accelab.serve.engines.base import ContinuousHooks, StepEngine
    from accelab.serve.scheduler import SchedulerConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class VllmSampling:
    seed: int | None  # the request's seed + this choice's index


class EngineProcessEngine(HFGenerationEngine):
    """Prompts prepared here; tokens from the engine process (`continuous_worker`), or, for the
    warm-up and `--scheduler static`, one greedy batch through the Runnable."""

    def __init__(self, runnable: Any, *, name: str):
        self.client = runnable.model.client
        self.backend = runnable.plan.backend
        self.runtime = self.client.info.runtime  # vLLM, OpenVINO GenAI
        super().__init__(runnable, name=name, max_context=self.client.info.max_model_len, steps=None, worker="engine")

    def warmup(self) -> None:
        ids = list(self.prepare_chat([{"role": "user", "content": "Hello"}]).ids)
        self.runnable.generate({"input_ids": torch.tensor([ids])}, max_new_tokens=2)

    def continuous_worker(self, config: ServeConfig, hooks: ContinuousHooks) -> VllmWorker:
        if config.scheduler == "static":
            log.warning(
                "--scheduler static does not apply to backend %s: %s schedules every step itself",
                self.backend,
                self.runtime,
            )
        info = self.client.info
        if config.max_batch_size != info.max_num_seqs:
            log.info(
                "%s runs up to %d sequences at once (%s_max_num_seqs), whatever --max-batch-size says",
                self.runtime,
                info.max_num_seqs,
                "ov" if self.backend == "openvino" else "vllm",
            )
        return VllmWorker(
            self.client, max_queue=config.max_queue, decode=self.decode, eos_ids=self.eos_ids, hooks=hooks
        )

    def sampler(self, params: Any, prompt: Any, *, grammar: Any = None, seed_offset: int = 0) -> VllmSampling:
        """What the routes attach to a unit: the engine samples (temperature, top-p/k, min-p, penalties,
        logit bias on vLLM, min_tokens, ignore_eos run in its sampler); what it cannot take here is
        refused with a 400 that names the field."""
        if grammar is not None:
            raise FieldNotSupported(
                f"response_format and tools need a grammar-constrained sampler, which backend {self.backend} "
                "does not run in accelab yet; serve a torch plan for structured output"
            )
        if params.logprobs is not None or params.prompt_logprobs is not None:
            raise FieldNotSupported(
                f"logprobs are not returned by backend {self.backend} in accelab yet; drop logprobs/echo, "
                "or serve a torch plan"
            )
        for name in self.client.info.refuses:  # what the engine's own sampler lacks
            if getattr(params, name):
                raise FieldNotSupported(
                    f"{name}: {self.runtime}'s sampler does not take it; drop the field, or serve a torch plan"
                )
        return VllmSampling(seed=None if params.seed is None else params.seed + seed_offset)

    def step_engine(self, limits: SchedulerConfig) -> StepEngine:
        raise Unsupported(f"{self.runtime} schedules its own steps (continuous_worker)")
