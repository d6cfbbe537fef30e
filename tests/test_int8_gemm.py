"""The int8 x bf16 GEMM operator (AMX): the dequantized weight's product, for decoding-sized and
prefill-sized inputs, with and without bias, rows past a multiple of 64 padded; what it does not
take is said."""

from __future__ import annotations

import pytest
import torch

from accelab.serve.engines import int8_gemm, kernels

AMX = all(flag in kernels.cpu_flags() for flag in int8_gemm.NEEDS)


def _weights(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n + k)
    return torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g), torch.rand(n, generator=g) * 0.02 + 1e-3


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40])
@pytest.mark.parametrize(("n", "k"), [(128, 64), (960, 576), (64, 1536), (100, 64)])
def test_the_operator_gives_the_dequantized_weights_product(rows, n, k):
    if not AMX:  # this CPU: the operator is not offered, and the reason names what is missing
        why = int8_gemm.available(n, k)
        assert why is not None and "AMX" in why
        return
    assert int8_gemm.available(n, k) is None
    values, scales = _weights(n, k)
    values[0, :4] = torch.tensor([-128, -127, 0, 127], dtype=torch.int8)  # the ends, and zero (sign-magnitude)
    x = torch.randn(rows, k).bfloat16()
    bias = torch.randn(n).bfloat16() if rows % 2 else None
    want = x.float() @ (values.float() * scales[:, None]).T + (0 if bias is None else bias.float())
    packed = int8_gemm.pack(values)  # 100 rows: padded to 128, the output cut back to 100
    assert packed.shape[0] * 64 == -(-n // 64) * 64
    padded_bias = None if bias is None else int8_gemm.pad(bias)
    got = int8_gemm.linear(x, packed, int8_gemm.pad(scales), padded_bias, rows=n)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    assert float((got.float() - want).abs().max()) <= 8e-3 * float(want.abs().max())  # bf16 rounding of the output


def test_what_the_operator_does_not_take_is_said():
    assert "a multiple of 32" in (int8_gemm.available(128, 48) or "")
    if AMX:
        values, scales = _weights(128, 64)
        with pytest.raises(RuntimeError, match="bfloat16"):
            int8_gemm.linear(torch.randn(2, 64), int8_gemm.pack(values), scales)
        with pytest.raises(RuntimeError, match="columns"):
            int8_gemm.linear(torch.randn(2, 32).bfloat16(), int8_gemm.pack(values), scales)
