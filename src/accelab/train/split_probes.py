"""What the step split (accelab.train.step_split) reads from torch: the time of DDP's gradient
all-reduce, through a communication hook, and the FLOPs of one forward, for the MFU."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from accelab.measure.flops import count_flops
from accelab.train.step_split import StepSplit

log = logging.getLogger(__name__)


def probe(split: StepSplit, accelerator: Any, model: Any, batch: dict[str, Any]) -> None:
    """Once per run, before the first forward: the DDP all-reduce timed (split.comm "ddp") and
    the FLOPs of a forward on this micro-batch counted. The caller pauses its step timer."""
    if split.comm == "ddp" and not time_allreduce(model, split):
        log.warning("a DDP run whose model is not DDP-wrapped: its communication is not measured")
        split.comm = "none"
    split.forward_flops_per_sample = forward_flops_per_sample(accelerator, model, batch)
    split.probed = True


def time_allreduce(model: Any, split: StepSplit) -> bool:
    """Replace DDP's gradient all-reduce by the same all-reduce timed: each bucket's interval,
    from the hook's call to its future's completion, goes to `split`. False when `model` is not
    DDP (one process, or FSDP).

    accelerate's `DistributedDataParallelKwargs(comm_hook=...)` takes only its built-in hook
    types (fp16 / bf16 compression, PowerSGD), so the hook is registered on the prepared DDP
    module directly (works on gloo: measured on 2 CPU ranks). It must run before the first
    backward. The hook's future is the chained one: DDP waits for it, so every bucket's
    interval is recorded before backward returns."""
    ddp = getattr(model, "_orig_mod", model)  # under torch.compile accelerate compiles the DDP module
    if not isinstance(ddp, DistributedDataParallel):
        return False

    # unannotated: DDP compares the hook's annotations with dist.GradBucket and Future[Tensor] at
    # registration, and this module's are strings (`from __future__ import annotations`)
    def timed_allreduce(state, bucket):
        started = split.comm_started()

        def done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            split.comm_done(started)
            return fut.value()

        return allreduce_hook(state, bucket).then(done)

    ddp.register_comm_hook(None, timed_allreduce)  # state None: DDP's own process group
    return True


def forward_flops_per_sample(accelerator: Any, model: Any, batch: dict[str, Any]) -> float | None:
    """FLOPs of one forward per sample (torch's FlopCounterMode on this micro-batch; a training
    step is ~3x). Runs the unwrapped, uncompiled model in eval mode under no_grad, the RNG state
    restored: the training that follows is unchanged. Every rank must call it (an FSDP forward
    all-gathers). None when the count fails (logged): the MFU is then not reported."""
    module = accelerator.unwrap_model(model, keep_torch_compile=False)  # autocast kept: the row's precision
    samples = next((len(v) for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() > 0), 0)
    devices = [accelerator.device] if accelerator.device.type == "cuda" else []
    was_training = module.training
    try:
        with torch.random.fork_rng(devices=devices):
            module.eval()
            flops = count_flops(module, **batch)
    except Exception as e:  # noqa: BLE001 - the MFU is optional; the training must go on
        log.warning("counting the forward's FLOPs failed (%s: %s); no MFU for this run", type(e).__name__, e)
        return None
    finally:
        module.train(was_training)
    return flops / samples if flops and samples else None
