"""`accelab serve --plan vllm`: accelab's server in front of vLLM's engine.

accelab's routes, limits, errors, streaming and /metrics stay as for every engine; the prompt is
prepared by `HFGenerationEngine` (chat template, tokenizer, context check) in this process, and the
tokens are made by vLLM's AsyncLLM in accelab's vLLM engine process, which schedules them itself
(`VllmWorker` replaces the continuous worker). Why not front `vllm serve`: its OpenAI layer would
tokenise, detokenise and validate a second time, and accelab's admission control, deadlines and
metrics would sit outside the engine's queue instead of beside it (see README, vLLM runtime).

The engine process belongs to this server (keep 0): it leaves when the server does.
"""

from __future__ import annotations

import logging
from typing import Any

from accelab.plan.runtime import Unsupported
from accelab.serve.engines.generation import HFGenerationEngine
from accelab.serve.engines.vllm_worker import VllmWorker

log = logging.getLogger(__name__)


def build_vllm_engine(spec: Any, plan: Any, device: Any, *, name: str) -> "VllmServeEngine":
    from accelab.backends import vllm
    from accelab.runtimes import check_supported

    check_supported(plan, spec, device)
    return VllmServeEngine(vllm.load(spec, plan, device, keep_s=0.0), name=name)


class VllmServeEngine(HFGenerationEngine):
    """Prompts prepared here; tokens from vLLM (`continuous_worker`), or, for the warm-up and
    `--scheduler static`, one greedy batch through the Runnable."""

    def __init__(self, runnable: Any, *, name: str):
        self.client = runnable.model.client
        super().__init__(runnable, name=name, max_context=self.client.info.max_model_len)

    def continuous_worker(self, config: Any, hooks: Any) -> VllmWorker:
        if config.scheduler == "static":
            log.warning("--scheduler static does not apply to --plan vllm: vLLM schedules every step itself")
        info = self.client.info
        if config.max_batch_size != info.max_num_seqs:
            log.info("vLLM runs up to %d sequences at once (vllm_max_num_seqs), whatever --max-batch-size says",
                     info.max_num_seqs)
        return VllmWorker(self.client, max_queue=config.max_queue, decode=self.decode, eos_ids=self.eos_ids,
                          hooks=hooks)

    def step_engine(self, limits: Any) -> Any:
        raise Unsupported("vLLM schedules its own steps (continuous_worker)")
