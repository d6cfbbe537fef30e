"""The plan space a tune searches: what is pruned here, and why."""

import pytest
import torch

from accelab.catalog.resolve import resolve
from accelab.measure.hardware import HardwareLimits
from accelab.plan.presets import PRESETS
from accelab.tuner import space
from accelab.tuner.space import search_space, slow_here, techniques


def test_techniques_name_what_a_plan_changes():
    assert techniques(PRESETS["baseline"]) == []
    assert techniques(PRESETS["static-cache"]) == []  # a cache layout, not a technique the report judges
    assert techniques(PRESETS["bf16-autocast"]) == ["bf16-autocast"]
    assert techniques(PRESETS["bf16"]) == ["bf16-weights"]
    assert techniques(PRESETS["int8-weight-compile"]) == ["compile", "int8-weight"]
    assert techniques(PRESETS["onnxruntime"]) == ["onnxruntime"]


def _limits(bf16_ratio: float) -> HardwareLimits:
    return HardwareLimits(
        device="cpu",
        fp32_flops=300e9,
        bf16_flops=300e9 * bf16_ratio,
        tf32_flops=None,
        bandwidth_bytes_per_s=20e9,
        threads=2,
        measured_at="2026-11-30T00:00:00+00:00",
        fingerprint="test",
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="judges this machine's CPU; with a GPU the report judges the GPU")
@pytest.mark.parametrize("ratio, slow", [(0.5, True), (1.6, False)])
def test_slow_here_follows_the_measured_bf16_rate(monkeypatch, ratio, slow):
    # the limits are set by hand (a CPU whose bf16 matmul runs at `ratio` x fp32); the environment is this machine's
    monkeypatch.setattr("accelab.measure.hardware.cached_limits", lambda device="cpu", **_: _limits(ratio))
    found = slow_here(torch.device("cpu"))
    assert ("bf16-autocast" in found and "bf16-weights" in found) is slow
    if slow:
        assert "measured bf16 matmul 150.0 GFLOP/s vs fp32 300.0" in found["bf16-autocast"]


def test_the_default_space_leaves_out_slow_techniques_unless_asked_for(monkeypatch):
    spec = resolve("smollm2-135m")
    monkeypatch.setattr(
        space,
        "slow_here",
        lambda device: {"bf16-autocast": "measured bf16 slower (test)", "bf16-weights": "measured bf16 slower (test)"},
    )
    pruned = search_space(spec, "generate", "cpu", max_batch=8, prune_slow=True)
    assert "bf16-autocast" in pruned.pruned and "bf16" in pruned.pruned
    assert "measured bf16 slower (test)" in pruned.pruned["bf16"] and "--include" in pruned.pruned["bf16"]
    assert {"baseline", "static-cache"} <= set(pruned.variants)
    assert not {"bf16-autocast", "bf16"} & set(pruned.variants)
    assert pruned.batch_sizes == [1, 2, 4, 8]

    kept = search_space(spec, "generate", "cpu", max_batch=8, include=["bf16-autocast", "static-cache"])
    assert kept.variants == ["baseline", "bf16-autocast", "static-cache"]  # asked for by name: searched
