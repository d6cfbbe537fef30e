"""The continuous steps' Linear layers on oneDNN with weights packed once (CPU).

A decoding step multiplies a few rows (one per sequence) by every weight of the model, so the
step is bound by how fast the GEMM streams weights. MKL's sgemm behind `F.linear` re-reads the
row-major weight for each call; oneDNN's inner-product with a weight reordered once into its
blocked layout (what inductor's freezing does on CPU) streamed SmolLM2's 210 layer weights
1.7-3x faster at 1-64 rows here (benchmarks/profile_serve_step.py has the figures). The packed
copy costs the weights' size again in memory, so it is taken only for float weights on CPU
with oneDNN present, and undone by `unpack`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

log = logging.getLogger(__name__)

BATCH_HINT = 16  # rows oneDNN picks the weight layout for (1 to 64 rows all ran fastest with it)


def available(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinears:
    """Every plain nn.Linear of `model` (but `skip`) computed by oneDNN from a packed copy of its weight."""

    def __init__(self, model: torch.nn.Module, *, skip: tuple[torch.nn.Module, ...] = ()):
        self._patched: list[torch.nn.Linear] = []
        self.nbytes = 0
        with torch.no_grad():
            for module in model.modules():
                if type(module) is not torch.nn.Linear or module in skip or not module.weight.is_floating_point():
                    continue
                packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), BATCH_HINT)
                # an instance attribute shadows nn.Linear.forward (unpack deletes it)
                module.__dict__["forward"] = _packed_forward(packed, module.bias, module.out_features)
                self._patched.append(module)
                self.nbytes += module.weight.numel() * module.weight.element_size()
        log.info(
            "oneDNN packed weights for %d Linear layers (%.0f MB more memory)", len(self._patched), self.nbytes / 1e6
        )

    def __len__(self) -> int:
        return len(self._patched)

    def unpack(self) -> None:
        for module in self._patched:
            del module.forward  # back to nn.Linear.forward
        self._patched = []

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """The model's own Linear forward meanwhile (the reference the checks compare with)."""
        saved = [(m, m.__dict__.pop("forward")) for m in self._patched]
        try:
            yield
        finally:
            for module, forward in saved:
                module.__dict__["forward"] = forward


def _packed_forward(packed: torch.Tensor, bias: Any, out_features: int):
    bias = None if bias is None else bias.detach()

    def forward(x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        flat = x.reshape(-1, x.shape[-1])
        if not flat.is_contiguous():
            flat = flat.contiguous()
        out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
        return out.reshape(*x.shape[:-1], out_features)

    return forward
