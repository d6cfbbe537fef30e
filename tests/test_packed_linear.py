"""oneDNN-packed Linear layers with a ViT MLP run as one function (fp32: its GELU inside the first
GEMM; bf16: a tanh GELU computed as erf's after it): the same outputs as the module's own forward
(fp32 to rounding, bf16 within its precision), QuickGELU left unfused, and `unpack` gives the
class's forward back."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN

from accelab.serve.engines import packed_linear
from accelab.serve.engines.packed_linear import PackedLinears


class MLP(torch.nn.Module):
    def __init__(self, act: str):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)
        self.activation_fn = ACT2FN[act]

    def forward(self, x):
        return self.fc2(self.activation_fn(self.fc1(x)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_mlps_gelu_runs_inside_its_first_gemm_with_the_same_outputs(dtype):
    if not packed_linear.available(torch.device("cpu"), dtype):
        pytest.skip(f"this CPU has no oneDNN {dtype} path")  # bf16 needs AVX512-BF16 or AMX
    torch.manual_seed(0)
    model = torch.nn.Sequential(MLP("gelu_pytorch_tanh"), MLP("gelu"), MLP("quick_gelu")).to(dtype)
    x = torch.randn(2, 300, 64, dtype=dtype)
    with torch.inference_mode():
        want = model(x)
        packed = PackedLinears(model, batch_hint=300, fuse_gelu=True)
        assert packed.mlps == 2  # QuickGELU has no oneDNN algorithm: its Linears are packed alone
        assert "forward" in model[0].__dict__ and "forward" not in model[2].__dict__
        got = model(x)
        with packed.suspended():
            assert torch.equal(model(x), want)
        packed.unpack()
        assert torch.equal(model(x), want) and all("forward" not in m.__dict__ for m in model.modules())
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    assert got.shape == want.shape
    assert float((got.float() - want.float()).abs().max()) <= tolerance * float(want.abs().max())
