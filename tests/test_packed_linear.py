"""oneDNN-packed Linear layers with a ViT MLP run as one function (fp32: its GELU inside the first
GEMM; bf16: a tanh GELU computed as erf's after it): the same outputs as the module's own forward
(fp32 to rounding, bf16 within its precision), QuickGELU left unfused, and `unpack` gives the
class's forward back."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN

from accelab.serve.runner import packed_linear
from accelab.serve.runner.packed_linear import PackedLinears

pytestmark = pytest.mark.cpu_kind  # its path depends on the CPU (make test-avx2)


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
        packed = PackedLinears(model, batch_hint=300, vit=True)
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


def vit_layers(kind: str, dtype: torch.dtype) -> torch.nn.ModuleList:
    """Two encoder layers of a real ViT architecture, small: SigLIP's (Idefics3's tower) or CLIP's (LLaVA's)."""
    from transformers import CLIPVisionConfig, SiglipVisionConfig
    from transformers.models.clip.modeling_clip import CLIPEncoderLayer
    from transformers.models.siglip.modeling_siglip import SiglipEncoderLayer

    torch.manual_seed(0)
    sizes = dict(hidden_size=64, intermediate_size=256, num_attention_heads=4)
    if kind == "siglip":
        config = SiglipVisionConfig(**sizes, hidden_act="gelu_pytorch_tanh")
        config._attn_implementation = "sdpa"
        layers = [SiglipEncoderLayer(config) for _ in range(2)]
    else:
        config = CLIPVisionConfig(**sizes, hidden_act="quick_gelu")
        config._attn_implementation = "sdpa"
        layers = [CLIPEncoderLayer(config) for _ in range(2)]
    return torch.nn.ModuleList(layers).to(dtype).eval()


@pytest.mark.parametrize("kind", ["siglip", "clip"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_vit_layer_runs_as_one_function_with_the_layers_outputs(kind, dtype):
    """The residual added inside the GEMMs and q|k|v as one: the layer's own outputs (fp32 to
    rounding, bf16 within its precision); a call with an attention mask runs the layer's own
    forward; `suspended` and `unpack` give the model's own layers back."""
    if not packed_linear.available(torch.device("cpu"), dtype):
        pytest.skip(f"this CPU has no oneDNN {dtype} path")  # bf16 needs AVX512-BF16 or AMX
    layers = vit_layers(kind, dtype)
    x = torch.randn(2, 100, 64, dtype=dtype)
    mask = torch.zeros(2, 1, 100, 100, dtype=dtype)
    mask[:, :, :, 90:] = torch.finfo(dtype).min  # the last 10 patches padding

    def run(masked: bool = False) -> torch.Tensor:
        h = x
        for layer in layers:
            h = layer(h, mask if masked else None)
        return h

    with torch.inference_mode():
        want, want_masked = run(), run(masked=True)
        packed = PackedLinears(layers, batch_hint=200, vit=True)
        assert packed.vit_layers == 2 and packed.mlps == 0
        assert all("forward" in layer.__dict__ for layer in layers)
        got, got_masked = run(), run(masked=True)
        with packed.suspended():
            assert torch.equal(run(), want)
        packed.unpack()
        assert torch.equal(run(), want) and all("forward" not in m.__dict__ for m in layers.modules())
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    scale = float(want.abs().max())
    assert float((got.float() - want.float()).abs().max()) <= tolerance * scale
    assert torch.equal(got_masked, want_masked)  # a mask: the layer's own forward (its Linears unpacked)


def test_a_layer_of_another_shape_keeps_its_own_forward():
    layers = vit_layers("siglip", torch.float32)
    for layer in layers:
        layer.self_attn.q_proj.bias = None  # no bias: not the layer this fusion knows
    with torch.inference_mode():
        packed = PackedLinears(layers, batch_hint=200, vit=True)
    assert packed.vit_layers == 0 and packed.mlps == 2  # its MLPs still run as one function
    assert all("forward" not in layer.__dict__ for layer in layers)
    packed.unpack()
