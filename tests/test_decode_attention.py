"""The decoding attention kernel (C++, built once per machine) against the tensor-op attention
of the compiled steps: float32 and bfloat16 caches, grouped-query heads, ragged positions over
scattered blocks, sliding windows; what it does not take is said, not guessed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from accelab.ops import decode_attention as kernel
from accelab.serve.runner.compiled_decode import _attend, _mask

pytestmark = pytest.mark.cpu_kind  # its path depends on the CPU (make test-avx2)


@pytest.mark.parametrize(
    ("dtype", "heads", "kv_heads", "dim", "window"),
    [
        (torch.bfloat16, 9, 3, 64, None),  # SmolLM2's heads
        (torch.float32, 8, 2, 128, None),
        (torch.bfloat16, 4, 2, 16, 8),  # the tests' tiny models, a sliding window
        (torch.float32, 4, 4, 32, 20),
    ],
)
def test_the_kernel_gives_the_tensor_op_attention(dtype, heads, kv_heads, dim, window):
    assert kernel.available(dtype, dim) is None
    torch.manual_seed(0)
    blocks, size, batch, columns = 64, 16, 6, 5
    keys = torch.randn(blocks, size, kv_heads, dim, dtype=dtype)
    values = torch.randn(blocks, size, kv_heads, dim, dtype=dtype)
    tables = torch.randperm(blocks)[: batch * columns].view(batch, columns)  # scattered blocks
    positions = torch.tensor([0, 1, 15, 16, 47, columns * size - 1])  # block edges, one position
    q = torch.randn(batch, heads, dim, dtype=dtype)
    where = (tables[:, :, None] * size + torch.arange(size)).reshape(batch, -1)
    flat_k, flat_v = keys.view(-1, kv_heads, dim), values.view(-1, kv_heads, dim)
    want = _attend(q[:, None], flat_k, flat_v, where, _mask(positions[:, None], where.shape[1], window), 0.3, kv_heads)
    got = kernel.decode_attention(q, keys, values, tables, positions, 0.3, window)
    assert got.dtype == torch.float32 and got.shape == (batch, heads, dim)
    torch.testing.assert_close(got.view(batch, -1), want, rtol=1e-5, atol=1e-5)
    # the first query sees only its own position: the output is that value, head by head
    own = values[tables[0, 0], 0].float().repeat_interleave(heads // kv_heads, dim=0)
    torch.testing.assert_close(got[0], own, rtol=1e-6, atol=1e-6)


def test_what_the_kernel_does_not_take_is_said():
    assert "float16" in (kernel.available(torch.float16, 64) or "")
    assert "not 48" in (kernel.available(torch.float32, 48) or "")
    q = torch.randn(1, 2, 48)
    cache = torch.randn(4, 4, 2, 48)
    with pytest.raises(RuntimeError, match="head_dim"):
        torch.ops.accelab.decode_attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.long), torch.zeros(1), 1.0, 0)


def _available_in_a_new_process(kernels, **env) -> str:
    code = (
        "import time, torch; from accelab.ops import decode_attention as k; t = time.time(); "
        "why = k.available(torch.float32, 64); print(repr(why), round(time.time() - t, 2), k.LIBRARY.path())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "ACCELAB_KERNELS": str(kernels), **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return done.stdout.strip().splitlines()[-1]


def test_a_machine_without_a_build_builds_once_then_loads_it_and_a_failed_build_is_said(tmp_path):
    kernels = tmp_path / "kernels"
    first = _available_in_a_new_process(kernels)
    assert first.startswith("None ") and first.endswith(".so") and str(kernels) in first
    built = list(kernels.glob("*/*.so"))
    assert len(built) == 1 and not list(kernels.glob("*.build-*"))  # moved into place, scratch removed
    again = _available_in_a_new_process(kernels)
    assert again.startswith("None ") and float(again.split()[1]) < 2.0  # loaded, not compiled again
    # no compiler: the reason, and nothing left half-built where a later process would load it
    failed = _available_in_a_new_process(tmp_path / "elsewhere", CXX="/bin/false")
    assert failed[1:].startswith("it did not build: ") and "/bin/false" in failed
    assert not list((tmp_path / "elsewhere").glob("*/*"))  # no library, no scratch left behind
