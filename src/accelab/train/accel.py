"""The Accelerator of a training run, and whether its mixed precision works on this device.

One Accelerator per process (accelerate's state is a process singleton): `accelab train` runs
every training, and every bench row, in its own worker process(es).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from accelab.train.config import TrainConfig

log = logging.getLogger(__name__)


class Unsupported(Exception):
    """A technique that cannot run on this device; reported as such, never run as something else."""


def uses_cuda(config: TrainConfig) -> bool:
    return torch.cuda.is_available() and not config.cpu


def precision_problem(mixed_precision: str, *, cuda: bool, bf16_on_gpu: bool | None = None) -> str | None:
    """Why `mixed_precision` cannot run here, or None. Pure given its arguments."""
    if mixed_precision == "fp16" and not cuda:
        return (
            "fp16 mixed precision needs a GPU: on CPU accelerate's fp16 autocast is a silent no-op "
            "(the run would be plain fp32). Use --mixed-precision bf16 or no"
        )
    if mixed_precision == "bf16" and cuda and bf16_on_gpu is False:
        return "this GPU has no native bf16 (compute capability 8.0+ needed); use --mixed-precision fp16"
    return None


def check_precision(config: TrainConfig) -> None:
    cuda = uses_cuda(config)
    bf16 = torch.cuda.is_bf16_supported(including_emulation=False) if cuda else None
    problem = precision_problem(config.mixed_precision, cuda=cuda, bf16_on_gpu=bf16)
    if problem:
        raise Unsupported(problem)


def make_accelerator(config: TrainConfig) -> Any:
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, TorchDynamoPlugin

    check_precision(config)
    output = Path(config.output_dir)
    dynamo = None
    if config.compile != "off":
        dynamo = TorchDynamoPlugin(backend="inductor", mode=config.compile)
    accelerator = Accelerator(
        # cpu=True on CPU machines: under torchrun this makes the ranks join one gloo process group
        # (without it, each rank would run a separate world-size-1 training). GPUs use NCCL.
        cpu=not uses_cuda(config),
        mixed_precision=config.mixed_precision,
        gradient_accumulation_steps=config.grad_accum,
        # split_batches: each dataloader batch is the global micro-batch, cut into one slice per
        # rank, so the data of every optimizer step does not depend on the number of processes.
        dataloader_config=DataLoaderConfiguration(split_batches=True, even_batches=True),
        log_with=None if config.log_with == "none" else config.log_with,
        project_config=ProjectConfiguration(project_dir=str(output), logging_dir=str(output / "tensorboard")),
        dynamo_plugin=dynamo,
    )
    if config.mixed_precision != "no" and not accelerator.native_amp:
        raise Unsupported(
            f"{config.mixed_precision} mixed precision is not native on {accelerator.device}; "
            "accelerate would run fp32 instead"
        )
    if accelerator.num_processes != config.world_size:
        raise ValueError(
            f"this worker runs in {accelerator.num_processes} process(es) but the run was set up for "
            f"{config.world_size}; start it with `accelab train --nproc N` (which launches torchrun)"
        )
    return accelerator
