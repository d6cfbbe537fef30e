"""One small timed probe per technique whose speed depends on the CPU: what it does to a
transformer MLP (768 -> 3072 -> 768, GELU, 32 tokens) against fp32 eager on the same machine,
as a factor (2.0 = twice as fast, 0.15 = about seven times slower). Measured with the hardware
limits and cached with them, so `accelab env`, compare, tune and train --bench can say "slow
(0.15x fp32)" before they spend minutes finding out.

The probe runs what the plan's technique runs: autocast for bf16-autocast, bf16 weights for
bf16-weights, and torchao's configs (the same `make_config`) for the int8 plans.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from accelab.measure import kernels

log = logging.getLogger(__name__)

TOKENS, HIDDEN = 32, 768
SLOW_BELOW = 0.8  # a technique probed below this factor is reported "slow"


def _mlp() -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(HIDDEN, 4 * HIDDEN), torch.nn.GELU(),
                                   torch.nn.Linear(4 * HIDDEN, HIDDEN)).eval()


def _variant(technique: str, device: torch.device) -> tuple[torch.nn.Module, torch.dtype, Callable[[], Any]]:
    """(the model under the technique, its input dtype, the context its calls run in)."""
    model = _mlp().to(device)
    if technique == "bf16-autocast":
        return model, torch.float32, lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    if technique in ("bf16-weights", "fp16-weights"):
        dtype = torch.bfloat16 if technique.startswith("bf16") else torch.float16
        return model.to(dtype), dtype, nullcontext
    if technique in ("int8-weight", "int8-dynamic"):
        from torchao.quantization import quantize_

        from accelab.plan.techniques.quantization import make_config

        quantize_(model, make_config(technique, device))
        return model, torch.float32, nullcontext
    return model, torch.float32, nullcontext  # "fp32": the reference


def techniques(device: torch.device) -> list[str]:
    names = ["bf16-autocast", "bf16-weights", "fp16-weights"]
    if importlib.util.find_spec("torchao") is not None:
        names += ["int8-weight", "int8-dynamic"]
    return names if device.type == "cpu" else []  # GPUs: the capability checks know their tensor cores


def _seconds(technique: str, device: torch.device) -> float:
    model, dtype, context = _variant(technique, device)
    x = torch.randn(TOKENS, HIDDEN, device=device).to(dtype)

    def call() -> Any:
        with torch.inference_mode(), context():
            return model(x)

    return kernels.best_seconds(call, device, repeats=5)


def probe_all(device: torch.device) -> dict[str, float]:
    """{technique: speed against fp32 eager}; a technique that fails here is left out."""
    reference = _seconds("fp32", device)
    factors: dict[str, float] = {}
    for technique in techniques(device):
        try:
            factors[technique] = reference / _seconds(technique, copy.copy(device))
        except Exception as err:  # noqa: BLE001 - a probe that cannot run says nothing
            log.info("probe %s skipped: %s", technique, err)
            continue
        log.info("probe %s on %s: %.2fx fp32 eager", technique, device, factors[technique])
    return factors


def describe(factor: float) -> str:
    return f"measured {factor:.2f}x fp32 eager on a transformer MLP here"
