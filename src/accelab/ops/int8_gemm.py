"""int8 weights, one scale an output row, times float activations: the GEMMs of a served step from
fewer bytes, with an operator for each kind of x86 CPU (`for_dtype` picks the one for the step's
activations; `available` says why one does not run here).

- **AMX, bfloat16 activations** (`AMX`, csrc/int8_gemm_amx.cpp). A decoding step of a small model
  is bound by reading its weights: SmolLM2's 30 layers of bf16 GEMMs at 16 sequences stream their
  212 MB at ~18.5 GB/s, what a 2-core VM reads from memory at all (19-22 GB/s), so only fewer
  bytes make them faster. torch's int8 x bf16 kernel (`_weight_int8pack_mm`) reads int8 weights at
  ~4.8 GB/s there. This operator widens each 64-row slab to bf16 in the core's own cache (exact:
  |w| <= 127) and multiplies it on AMX's tiles (16 x 32 bf16 by 32 x 16, float32 sums), then
  scales each output row. `accelab::int8_linear(x [M, K] bf16, packed, scales [N] f32, bias [N]?)
  -> [M, N] bf16`: N padded to a multiple of 64, K a multiple of 32. Needs AMX, AVX512-BF16 and
  AVX512-VBMI; elsewhere the engines keep torch's kernel for bf16.
- **AVX2 + FMA, float32 activations** (`AVX2`, csrc/int8_gemm_avx2.cpp), for CPUs without native
  bf16, where bf16 activations are emulated several times slower than float32 (an AVX2-only EPYC:
  bf16 matmuls 21 GFLOP/s against 159 float32) and torch's int8 kernel is a scalar loop for
  float32. Panels of 16 output rows are widened to float32 in registers and multiplied by FMA:
  the dequantized weight's arithmetic from a quarter of float32's bytes.
  `accelab::int8_linear_f32(x [M, K] f32, packed [N/16, K, 16], scales [N] f32, bias [N] f32?)
  -> [M, N] f32`, N padded to a multiple of 16.

Both compute exactly what the dequantized weight computes (up to the order of the sums), so a
plan's quality is the quantization's, never the operator's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from accelab.ops import loader

NEEDS = ("amx_tile", "amx_bf16", "avx512_bf16", "avx512vbmi")  # the AMX operator's


@dataclass(frozen=True, eq=False)
class Kernel:
    """One int8 GEMM operator: the activations' dtype it takes, its library (with the CPU flags it
    needs), the multiple its output rows are padded to, and its weight layout (`pack`)."""

    name: str
    dtype: torch.dtype
    library: loader.Library
    block: int  # output rows are computed in blocks of this many (`pad`)
    layout: Callable[[torch.Tensor], torch.Tensor]  # int8 [N, K], N a multiple of `block` -> packed
    k_multiple: int = 1  # input columns must be a multiple of this

    def available(self, out_features: int, in_features: int) -> str | None:
        """None when the operator runs a [out_features, in_features] int8 weight here, else why not."""
        if in_features % self.k_multiple:
            return f"it takes weights of columns a multiple of {self.k_multiple}, not {out_features} x {in_features}"
        return self.library.ready()

    def pad(self, rows: torch.Tensor) -> torch.Tensor:
        """A weight's per-row values (scales, bias) with zero rows up to the packed weight's (a
        vocabulary of 49,192 becomes 49,216 for the AMX operator's blocks of 64)."""
        extra = -rows.shape[0] % self.block
        return rows if not extra else torch.cat([rows, rows.new_zeros(extra, *rows.shape[1:])])

    def pack(self, values: torch.Tensor) -> torch.Tensor:
        """int8 [N, K] -> the operator's layout, rows past a multiple of `block` padded with zeros."""
        return self.layout(self.pad(values))

    def linear(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None = None,
        rows: int | None = None,
    ) -> torch.Tensor:
        """x [M, K] (the operator's dtype) times the packed int8 weights, each output row times its
        scale, plus bias (`scales` float32 and `bias` padded as the weight: `pad`); the first `rows`
        outputs (None: all)."""
        op = getattr(torch.ops.accelab, self.library.op)
        out = op(x, packed, scales, bias)
        return out if rows is None or rows == out.shape[1] else out[:, :rows]

    def bind(
        self, values: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """x -> x @ (values * scales[:, None]).T + bias, the weight packed once (the operator's
        library loaded first; RuntimeError where it does not run here)."""
        if (why := self.available(*values.shape)) is not None:
            raise RuntimeError(f"the {self.name} operator does not run this weight here: {why}")
        packed, row_scales, n = self.pack(values), self.pad(scales.float()), values.shape[0]
        padded_bias = None if bias is None else self.pad(bias.to(self.dtype))
        return lambda x: self.linear(x.contiguous(), packed, row_scales, padded_bias, rows=n)


def _amx_layout(values: torch.Tensor) -> torch.Tensor:
    """For each 64 rows and 32 columns, four 16-row tiles with column pairs side by side (AMX's
    layout for the right-hand operand), each 64 values in the order the kernel's interleave reads
    them, as a sign bit and 7 bits of magnitude (-128 as the sign bit alone)."""
    n, k = values.shape
    tiles = values.reshape(n // 64, 4, 16, k // 32, 16, 2).permute(0, 3, 1, 4, 2, 5)
    # 64 values (half, lane, 8) -> (lane, half, 8): the unpacks interleave 8 bytes of each 128-bit lane
    order = tiles.reshape(-1, 2, 4, 8).permute(0, 2, 1, 3).to(torch.int16)
    signed = (order < 0).to(torch.int16) * 128 + order.abs() % 128
    return signed.to(torch.uint8).view(torch.int8).reshape(n // 64, k // 32, 4, 16, 16, 2).contiguous()


def _panels(values: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N / 16, K, 16]: for each 16 output rows, their values column by column."""
    n, k = values.shape
    return values.reshape(n // 16, 16, k).transpose(1, 2).contiguous()


def _amx_shape(x, packed, scales, bias):
    return x.new_empty((x.shape[0], packed.shape[0] * 64))


def _avx2_shape(x, packed, scales, bias):
    return x.new_empty((x.shape[0], packed.shape[0] * 16))


AMX = Kernel(
    name="AMX int8 x bf16",
    dtype=torch.bfloat16,
    library=loader.Library(
        "accelab_int8_gemm",
        "int8_gemm_amx.cpp",
        "int8_linear",
        _amx_shape,
        needs=NEEDS,
        needs_said="AMX, AVX512-BF16 and AVX512-VBMI",
    ),
    block=64,
    layout=_amx_layout,
    k_multiple=32,
)
AVX2 = Kernel(
    name="AVX2 int8 x f32",
    dtype=torch.float32,
    library=loader.Library(
        "accelab_int8_gemm_avx2",
        "int8_gemm_avx2.cpp",
        "int8_linear_f32",
        _avx2_shape,
        needs=("avx2", "fma"),
        needs_said="AVX2 and FMA",
    ),
    block=16,
    layout=_panels,
)
KERNELS: dict[torch.dtype, Kernel] = {k.dtype: k for k in (AMX, AVX2)}


def for_dtype(dtype: torch.dtype) -> Kernel | None:
    """The operator for activations of `dtype` (bfloat16: AMX; float32: AVX2), or None."""
    return KERNELS.get(dtype)


def available(out_features: int, in_features: int, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """None when an int8 GEMM operator runs a [out_features, in_features] weight with `dtype`
    activations here, else why not."""
    kernel = for_dtype(dtype)
    if kernel is None:
        return f"no int8 GEMM operator takes {dtype} activations (bfloat16 or float32)"
    return kernel.available(out_features, in_features)
