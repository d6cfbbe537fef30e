"""The int8 GEMM operators, one for each kind of x86 CPU: AMX with bf16 activations, AVX2 + FMA with
float32 ones. Each gives the dequantized weight's product for decoding-sized and prefill-sized
inputs, with and without bias, rows past its block padded; what it does not take is said. An
operator this CPU cannot run is skipped with the reason, and the reason is checked."""

from __future__ import annotations

import pytest
import torch

from accelab.ops import int8_gemm, loader as kernels

pytestmark = pytest.mark.cpu_kind  # its path depends on the CPU (make test-avx2)

KERNELS = {"amx-bf16": int8_gemm.AMX, "avx2-f32": int8_gemm.AVX2}


def _weights(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n + k)
    return torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g), torch.rand(n, generator=g) * 0.02 + 1e-3


def _runs(kernel: int8_gemm.Kernel) -> int8_gemm.Kernel:
    missing = [flag for flag in kernel.library.needs if flag not in kernels.cpu_flags()]
    if missing:
        why = kernel.available(128, 64)
        assert why is not None and kernel.library.needs_said in why  # the reason names what is missing
        pytest.skip(f"{kernel.name}: this CPU lacks {', '.join(missing)}")
    return kernel


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 16, 17, 40])
@pytest.mark.parametrize(("n", "k"), [(128, 64), (960, 576), (64, 1536), (100, 64), (40, 96)])
@pytest.mark.parametrize("name", KERNELS)
def test_the_operator_gives_the_dequantized_weights_product(name, rows, n, k):
    kernel = _runs(KERNELS[name])
    assert kernel.available(n, k) is None  # every k here is a multiple of 32 (the AMX operator's)
    values, scales = _weights(n, k)
    values[0, :4] = torch.tensor([-128, -127, 0, 127], dtype=torch.int8)  # the ends, and zero (sign-magnitude)
    x = torch.randn(rows, k).to(kernel.dtype)
    bias = torch.randn(n).to(kernel.dtype) if rows % 2 else None
    want = x.float() @ (values.float() * scales[:, None]).T + (0 if bias is None else bias.float())
    packed = kernel.pack(values)  # rows past the block: padded, the output cut back to n
    padded = -(-n // kernel.block) * kernel.block
    assert packed.numel() == padded * k
    got = kernel.linear(x, packed, kernel.pad(scales), None if bias is None else kernel.pad(bias), rows=n)
    assert got.dtype == kernel.dtype and got.shape == (rows, n)
    # bf16: the output's rounding; float32: the order of the sums
    tolerance = 8e-3 if kernel.dtype == torch.bfloat16 else 1e-5
    assert float((got.float() - want).abs().max()) <= tolerance * float(want.abs().max())
    bound = kernel.bind(values, scales, bias)  # packed once, the same product
    assert torch.equal(bound(x), got)


def test_a_step_of_no_rows_gives_no_rows():
    kernel = _runs(int8_gemm.AVX2)
    values, scales = _weights(32, 64)
    assert kernel.bind(values, scales, None)(torch.empty(0, 64)).shape == (0, 32)


def test_the_operator_for_each_activation_dtype_and_what_none_takes():
    assert int8_gemm.for_dtype(torch.bfloat16) is int8_gemm.AMX
    assert int8_gemm.for_dtype(torch.float32) is int8_gemm.AVX2
    assert int8_gemm.for_dtype(torch.float16) is None
    assert "no int8 GEMM operator takes torch.float16" in (int8_gemm.available(128, 64, torch.float16) or "")
    assert "a multiple of 32" in (int8_gemm.available(128, 48) or "")


@pytest.mark.parametrize("name", KERNELS)
def test_what_the_operator_does_not_take_is_said(name):
    kernel = _runs(KERNELS[name])
    values, scales = _weights(128, 64)
    other = torch.float32 if kernel.dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(RuntimeError, match="bfloat16" if kernel.dtype == torch.bfloat16 else "float32"):
        kernel.linear(torch.randn(2, 64).to(other), kernel.pack(values), kernel.pad(scales))
    with pytest.raises(RuntimeError, match="columns"):
        kernel.linear(torch.randn(2, 32).to(kernel.dtype), kernel.pack(values), kernel.pad(scales))


@pytest.mark.parametrize(("high", "kept"), [(0.6, False), (1.9, True), (None, True)])
def test_the_engine_keeps_the_operator_unless_env_measured_it_slower(monkeypatch, high, kept):
    """`accelab env`'s probe of the operator (int8-gemm-f32: a decoding step's GEMMs against the
    float32 ones) decides: measured slow, the engine runs the dequantized weight; not measured
    (or not trusted), the operator runs."""
    from types import SimpleNamespace

    from accelab.measure import hardware
    from accelab.serve.runner import llama_stack

    kernel = _runs(int8_gemm.AVX2)
    details = {} if high is None else {"int8-gemm-f32": {"factor": high, "low": high - 0.1, "high": high}}
    monkeypatch.setattr(hardware, "cached_limits", lambda device: SimpleNamespace(probe_details=details))
    llama_stack._measured_slow.cache_clear()
    try:
        assert (llama_stack.int8_operator(torch.float32, 128, 64) is kernel) is kept
        assert llama_stack.int8_operator(torch.float16, 128, 64) is None
    finally:
        llama_stack._measured_slow.cache_clear()
