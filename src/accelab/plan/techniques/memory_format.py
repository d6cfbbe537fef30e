"""Memory format: channels_last (NHWC) for convolutional models.

Convolution kernels (cuDNN, oneDNN) are faster on NHWC; the weights are converted here, and
the input images must be NHWC too, or every conv converts them again: the scenario passes
each batch through `prepare_batch`. Models whose only convolution is a patch embedding
(ViT) or that have none (text models) gain nothing, and are reported as unsupported.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from accelab.catalog.spec import ModelSpec
from accelab.plan.plan import Plan
from accelab.plan.runtime import Runnable, Unsupported
from accelab.plan.techniques import _model_info

log = logging.getLogger(__name__)


def check(plan: Plan, spec: ModelSpec, device: torch.device) -> None:
    if plan.memory_format != "channels_last":
        return
    config = _model_info.load_config(spec)
    model = _model_info.meta_model(spec, config) if config is not None else None
    if model is None:
        return  # unknown layout: apply converts what 4-D weights there are
    arch = _model_info.architecture(spec, config)
    convs = count_conv2d(model)
    if convs == 0:
        raise Unsupported(f"no convolution layers: channels_last changes nothing for {arch}")
    if convs == 1:
        raise Unsupported(
            f"{arch} has a single convolution (its patch embedding): channels_last changes nothing that matters"
        )


def count_conv2d(model: torch.nn.Module) -> int:
    return sum(isinstance(m, torch.nn.Conv2d) for m in model.modules())


def apply(runnable: Runnable, plan: Plan) -> None:
    if plan.memory_format != "channels_last":
        return
    runnable.model = runnable.model.to(memory_format=torch.channels_last)  # converts only 4-D (conv) weights
    convs = count_conv2d(runnable.model)
    runnable.notes.append(f"channels_last weights ({convs} conv layers); inputs converted per batch")
    log.info("channels_last: %d conv layers", convs)


def prepare_batch(batch: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """The batch with its 4-D float inputs (`pixel_values`, a custom model's images) in
    channels_last, when the plan asks for it."""
    if plan is None or plan.memory_format != "channels_last":
        return batch
    return {
        k: v.contiguous(memory_format=torch.channels_last)
        if torch.is_tensor(v) and v.dim() == 4 and v.is_floating_point()
        else v
        for k, v in batch.items()
    }
