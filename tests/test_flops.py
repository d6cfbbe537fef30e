"""FLOP counting, weight bytes as stored (tied, shared, quantized), roofline arithmetic."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from accelab.catalog.facts import weight_bytes
from accelab.measure.flops import count_flops, decode_roofline, mfu


def test_count_flops_of_a_linear():
    layer = nn.Linear(512, 512)
    assert count_flops(layer, torch.randn(8, 512)) == 2 * 8 * 512 * 512


def test_count_flops_counts_cpu_fused_attention():
    # scaled_dot_product_attention on CPU runs a fused kernel torch's counter has no formula for
    q, k = torch.randn(2, 4, 16, 8), torch.randn(2, 4, 32, 8)
    qk_and_av = 2 * (2 * 2 * 4 * 16 * 32 * 8)
    assert count_flops(torch.nn.functional.scaled_dot_product_attention, q, k, k) == qk_and_av
    # the same attention spelled out in matmuls counts the same
    assert count_flops(lambda: torch.softmax(q @ k.transpose(-1, -2), -1) @ k) == qk_and_av


def test_count_flops_passes_kwargs_and_does_not_build_a_graph():
    layer = nn.Linear(64, 32)
    outputs = []
    flops = count_flops(lambda x, scale: outputs.append(layer(x) * scale), torch.randn(4, 64), scale=2.0)
    assert flops == 2 * 4 * 64 * 32
    assert outputs[0].grad_fn is None  # ran under no_grad


def test_weight_bytes_of_plain_parameters_and_buffers():
    model = nn.Sequential(nn.Linear(10, 20), nn.BatchNorm1d(20))
    linear = (10 * 20 + 20) * 4
    batchnorm = 20 * 4 * 4 + 8  # weight, bias, running mean/var (fp32) + num_batches_tracked (int64)
    assert weight_bytes(model) == linear + batchnorm
    assert weight_bytes(model.half()) == linear // 2 + 20 * 2 * 4 + 8


class TiedLM(nn.Module):
    def __init__(self, vocab: int = 1000, dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight  # tied: one Parameter, two modules


def test_tied_embeddings_count_once():
    assert weight_bytes(TiedLM()) == 1000 * 64 * 4


def test_weights_sharing_storage_through_different_objects_count_once():
    model = TiedLM()
    # Same storage, different Parameter objects (what some loaders produce).
    model.lm_head.weight = nn.Parameter(model.embed.weight.detach())
    assert model.lm_head.weight is not model.embed.weight
    assert weight_bytes(model) == 1000 * 64 * 4


def test_views_into_one_fused_weight_count_their_union():
    fused = torch.zeros(3 * 64, 64)
    model = nn.Module()
    model.q = nn.Parameter(fused[:64])
    model.k = nn.Parameter(fused[64:128])
    model.qk_again = nn.Parameter(fused[:128])  # overlaps q and k: adds nothing
    assert weight_bytes(model) == 2 * 64 * 64 * 4


def test_meta_model_counts_logical_bytes():
    with torch.device("meta"):
        model = nn.Linear(128, 256)
    assert weight_bytes(model) == (128 * 256 + 256) * 4


def test_torchao_int8_weight_only_is_about_a_quarter():
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    model = nn.Sequential(nn.Linear(512, 512, bias=False), nn.Linear(512, 256, bias=False))
    fp32 = weight_bytes(model)
    assert fp32 == (512 * 512 + 512 * 256) * 4
    quantize_(model, Int8WeightOnlyConfig())
    assert type(model[0].weight) is not torch.Tensor  # a tensor subclass whose dtype still says fp32
    assert model[0].weight.dtype == torch.float32
    int8 = weight_bytes(model)
    assert int8 / fp32 == pytest.approx(0.25, rel=0.10)
    assert int8 > fp32 / 4  # the per-row scales add a little


def test_mfu():
    # 1 TFLOP per call in 10 ms = 100 TFLOP/s against a 400 TFLOP/s peak.
    assert mfu(1e12, 0.01, 400e12) == pytest.approx(0.25)
    assert mfu(2 * 8 * 512 * 512, 1e-4, 100e9) == pytest.approx(0.4194304)
    with pytest.raises(ValueError, match="seconds_per_call=0"):
        mfu(1e9, 0, 1e12)


def test_decode_roofline():
    # SmolLM2-135M fp32: 538 MB of weights at 20 GB/s: at most ~37 steps/s.
    roof = decode_roofline(538e6, step_seconds=1 / 14.6, bandwidth=20e9)
    assert roof["bound_steps_per_s"] == pytest.approx(20e9 / 538e6)
    assert roof["bound_steps_per_s"] == pytest.approx(37.17, abs=0.01)
    assert roof["achieved_steps_per_s"] == pytest.approx(14.6)
    assert roof["fraction"] == pytest.approx(14.6 / 37.1747, rel=1e-4)
    assert roof["achieved_bandwidth"] == pytest.approx(538e6 * 14.6)


def test_decode_roofline_counts_extra_bytes():
    roof = decode_roofline(1e9, step_seconds=0.1, bandwidth=10e9, extra_bytes_per_step=1e9)
    assert roof["bytes_per_step"] == 2e9
    assert roof["bound_steps_per_s"] == 5
    assert roof["fraction"] == 2  # faster than the bound: the bandwidth figure was wrong
    with pytest.raises(ValueError, match="bandwidth"):
        decode_roofline(1e9, 0.1, 0)
