"""The quality guard end to end on real models, through the CLI: SmolLM2's int8 weight-only plan
gives its generation figures, a deliberately corrupted plan fails (FAULT INJECTED by a test
fixture, tests/faults), and the vision-language smolvlm-tiny goes through bench, compare and
verify."""

from __future__ import annotations

import json

import pytest
from test_bench_e2e import QUICK, accelab, fault_env

pytestmark = pytest.mark.slow


def test_verify_smollm2_int8_weight_gives_the_generation_figures(tmp_path):
    out = tmp_path / "v.json"
    accelab(
        "verify",
        "smollm2-135m",
        "--plan",
        "int8-weight",
        "--samples",
        "4",
        "--new-tokens",
        "8",
        "--batch-size",
        "4",
        "--json",
        str(out),
        "--no-store",
    )
    quality = json.loads(out.read_text())["quality"]
    m = quality["metrics"]
    assert {
        "token_agreement",
        "prefix_agreement",
        "exact_match_rate",
        "perplexity_ref",
        "perplexity",
        "perplexity_change",
    } <= m.keys()
    assert 0 <= m["prefix_agreement"] <= m["token_agreement"] <= 1
    assert 5 < m["perplexity_ref"] < 100  # a real small chat model on held-out text
    assert abs(m["perplexity_change"]) < 0.10  # int8 weights barely move it
    assert quality["verdict"] in ("pass", "warn") and any(r.startswith("token_agreement=") for r in quality["rules"])


def test_verify_fails_a_corrupted_smollm2_plan(tmp_path):
    out = tmp_path / "bad.json"
    proc = accelab(
        "verify",
        "smollm2-135m",
        "--plan",
        "baseline",
        "--samples",
        "4",
        "--new-tokens",
        "8",
        "--batch-size",
        "4",
        "--json",
        str(out),
        "--no-store",
        env=fault_env("perturb-weights:0.3"),
        check=False,
    )
    assert proc.returncode == 1
    result = json.loads(out.read_text())
    assert any("FAULT INJECTED" in note for note in result["notes"])
    m = result["quality"]["metrics"]
    assert result["quality"]["verdict"] == "fail" and m["perplexity_change"] > 1.0  # perplexity more than doubles


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
        "baseline,bf16-autocast",
        *QUICK,
        "--samples",
        "2",
        "--json",
        str(compare),
        "--no-store",
    )
    rows = {r["plan"]: r for r in json.loads(compare.read_text())["rows"]}
    assert rows["baseline"]["status"] == rows["bf16-autocast"]["status"] == "ok"
    assert rows["baseline"]["quality"] == "pass"  # itself against the reference: the same tokens
    assert rows["baseline"]["quality_metrics"]["token_agreement"] == 1.0

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
