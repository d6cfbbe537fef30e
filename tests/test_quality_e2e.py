"""The quality guard end to end on real models, through the CLI: SmolLM2's int8 weight-only plan
gives the teacher-forced figures with their intervals, deliberately corrupted plans fail
(FAULT INJECTED by a test fixture, tests/faults) with their intervals clear of the line, and
the vision-language smolvlm-tiny goes through bench, compare and verify."""

from __future__ import annotations

import json

import pytest
from test_bench_e2e import QUICK, accelab, fault_env

from accelab import cpu

pytestmark = pytest.mark.slow
# the compared plan runs at the CPU's full speed: bf16 where it is native, else int8 weights (an
# emulated bf16 on an AVX2-only CPU runs past the comparison's budget)
SECOND_PLAN = "bf16-autocast" if cpu.native_bf16() else "int8-weight"

# one quality config for every SmolLM2 verify here: the fp32 reference is computed once and cached;
# 4 samples: 8 windows (1,024 tokens, half the 2,048 perplexity tokens these tests scored before)
SMOLLM2 = ["--samples", "4", "--new-tokens", "8", "--batch-size", "8", "--no-store"]
FIGURES = ("mean_kl", "p99_kl", "top1_agreement", "perplexity_ratio")


def verify_smollm2(tmp_path, plan: str, env=None) -> tuple[int, dict]:
    out = tmp_path / f"{plan}.json"
    proc = accelab("verify", "smollm2-135m", "--plan", plan, *SMOLLM2, "--json", str(out), env=env, check=False)
    assert out.exists(), proc.stderr[-3000:]
    return proc.returncode, json.loads(out.read_text())


def test_verify_smollm2_int8_weight_gives_the_teacher_forced_figures_with_intervals(tmp_path):
    code, result = verify_smollm2(tmp_path, "int8-weight")
    quality = result["quality"]
    m, iv = quality["metrics"], quality["intervals"]
    assert set(FIGURES) <= iv.keys() and {"token_agreement", "perplexity_ref", "perplexity"} <= m.keys()
    for name in FIGURES:
        assert iv[name][0] <= m[name] <= iv[name][1], name
    # 8 windows of 128 tokens, 96 scored each
    assert quality["sample"]["n"] == 8 and quality["sample"]["positions"] == 8 * 96
    assert 5 < m["perplexity_ref"] < 100  # a real small chat model on English prose
    # int8 weights barely move it: measured here KL ~0.004, top-1 ~0.95, perplexity +0.3%
    assert 0 < m["mean_kl"] < 0.015 and m["top1_agreement"] > 0.9 and 0.98 < m["perplexity_ratio"] < 1.03
    assert code == 0 and quality["verdict"] in ("pass", "warn", "cannot tell")
    assert [r.split("=")[0] for r in quality["rules"]] == ["mean_kl", "top1_agreement", "perplexity_ratio"]


def test_verify_fails_smollm2_with_scaled_rmsnorm_weights_with_the_interval_clear_of_the_line(tmp_path):
    code, result = verify_smollm2(tmp_path, "baseline", env=fault_env("rmsnorm-scale:1.05"))
    assert any("FAULT INJECTED" in note for note in result["notes"])
    quality = result["quality"]
    assert code == 1 and quality["verdict"] == "fail" and quality["possible"] == ["fail"]
    low, high = quality["intervals"]["mean_kl"]
    assert low > 0.015  # the balanced warn line: the whole interval is beyond it
    assert quality["rules"][0].startswith("mean_kl=") and " fail (" in quality["rules"][0]


def test_verify_fails_a_corrupted_smollm2_plan(tmp_path):
    code, result = verify_smollm2(tmp_path, "baseline", env=fault_env("perturb-weights:0.3"))
    assert code == 1
    assert any("FAULT INJECTED" in note for note in result["notes"])
    m = result["quality"]["metrics"]
    assert result["quality"]["verdict"] == "fail" and m["perplexity_ratio"] > 2.0  # perplexity more than doubles


def test_smolvlm_tiny_bench_compare_and_verify(tmp_path):
    bench = tmp_path / "b.json"
    accelab(
        "bench",
        "smolvlm-tiny",
        "--scenario",
        "generate",
        "--new-tokens",
        "4",
        *QUICK,
        "--json",
        str(bench),
        "--no-store",
    )
    m = json.loads(bench.read_text())["metrics"]
    assert m["ttft_ms"]["p50"] > 0 and m["decode_tokens_per_s"] > 0 and m["itl_ms"]["n"] == 3 * m["iterations"]

    compare = tmp_path / "c.json"
    accelab(
        "compare",
        "smolvlm-tiny",
        "--scenario",
        "generate",
        "--new-tokens",
        "4",
        "--plans",
        f"baseline,{SECOND_PLAN}",
        *QUICK,
        "--samples",
        "2",
        "--json",
        str(compare),
        "--no-store",
    )
    rows = {r["plan"]: r for r in json.loads(compare.read_text())["rows"]}
    assert rows["baseline"]["status"] == rows[SECOND_PLAN]["status"] == "ok"
    assert rows["baseline"]["quality"] == "pass"  # itself against the reference: the same distributions
    assert rows["baseline"]["quality_metrics"]["token_agreement"] == 1.0
    assert rows["baseline"]["quality_metrics"]["mean_kl"] < 1e-4

    verify = tmp_path / "v.json"
    accelab(
        "verify",
        "smolvlm-tiny",
        "--plan",
        "baseline",
        "--samples",
        "2",
        "--new-tokens",
        "4",
        "--batch-size",
        "2",
        "--json",
        str(verify),
        "--no-store",
    )
    quality = json.loads(verify.read_text())["quality"]
    assert quality["verdict"] == "pass" and quality["metrics"]["exact_match_rate"] == 1.0
    # 4 windows, each after a photo and its question: the image conditions every scored token
    assert quality["sample"]["n"] == 4 and quality["metrics"]["mean_kl"] < 1e-4
