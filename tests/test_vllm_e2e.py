"""backend vllm end to end on SmolLM2 with the real vLLM engine (.venv-vllm): compare against the
torch baseline and llama.cpp with quality verdicts, verify against the fp32 reference, and a tune
that measures vLLM plans and says why each lost or won. The engine of the `vllm` plan starts once
(the measuring children of the three commands reuse it); the engines this module started are
stopped at its end."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from engines import own_runtime_dir

from accelab.catalog.fetch import is_fetched

pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("vllm"),  # one worker: one vLLM engine (GiBs of KV cache) up at a time
    pytest.mark.alone,  # it measures speed: see tests/conftest.py
    pytest.mark.skipif(not is_fetched("smollm2-135m"), reason="run `accelab models fetch smollm2-135m` first"),
]

ENV: dict[str, str] = {}  # the commands' environment: engine_env
QUICK = ["--warmup", "1", "--min-iters", "3", "--min-seconds", "0.5"]


def accelab(*args, check=True):
    proc = subprocess.run(
        [sys.executable, "-m", "accelab", *args], capture_output=True, text=True, timeout=1500, env=ENV, check=False
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"accelab {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module", autouse=True)
def engine_env():
    with own_runtime_dir() as env:
        ENV.update(env, ACCELAB_VLLM_KEEP_S="300")  # a leftover engine leaves by itself
        yield
        ENV.clear()


def test_compare_baseline_vllm_gives_rows_with_verdicts(tmp_path):
    """(compare runs llama.cpp beside the baseline in tests/test_backends.py)"""
    out = tmp_path / "c.json"
    accelab(
        "compare",
        "smollm2-135m",
        "--scenario",
        "generate",
        "--plans",
        "baseline,vllm",
        "--new-tokens",
        "8",
        "--samples",
        "4",
        "--rounds",
        "2",
        *QUICK,
        "--json",
        str(out),
        "--no-store",
    )
    rows = {r["plan"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["baseline", "vllm"]
    verdicts = ("pass", "warn", "fail", "cannot tell")
    assert all(r["status"] == "ok" and r["quality"] in verdicts for r in rows.values()), rows
    vllm = rows["vllm"]
    assert vllm["quality"] == "pass"  # fp32 on vLLM: the reference's next-token distributions
    assert vllm["quality_metrics"]["token_agreement"] >= 0.9 and vllm["quality_metrics"]["mean_kl"] < 1e-3
    assert "vLLM 0.32.0" in vllm["notes"] and "float32, eager" in vllm["notes"]


def test_verify_vllm_passes_with_the_reference_tokens_and_perplexity(tmp_path):
    out = tmp_path / "v.json"
    accelab(
        "verify",
        "smollm2-135m",
        "--plan",
        "vllm",
        "--samples",
        "8",
        "--new-tokens",
        "16",
        "--json",
        str(out),
        "--no-store",
    )
    result = json.loads(out.read_text())
    quality = result["quality"]
    m = quality["metrics"]
    assert quality["verdict"] == "pass"
    assert m["token_agreement"] >= 0.9 and 5 < m["perplexity_ref"] < 100
    # vLLM's fp32 prompt logprobs score the text as torch does, its top-20 per position (max_logprobs)
    assert abs(m["perplexity_ratio"] - 1) < 0.01 and m["mean_kl"] < 1e-3 and m["top1_agreement"] > 0.99
    assert "top-20 (vllm engine)" in quality["sample"]["kl_over"]


def test_bench_vllm_fills_the_generate_contract(tmp_path):
    from accelab.results import contract as K

    out = tmp_path / "b.json"
    accelab(
        "bench",
        "smollm2-135m",
        "--plan",
        "vllm",
        "--scenario",
        "generate",
        "-b",
        "4",
        "--new-tokens",
        "8",
        *QUICK,
        "--json",
        str(out),
        "--no-store",
    )
    metrics = json.loads(out.read_text())["metrics"]
    for key in (K.TTFT_MS, K.TPOT_MS, K.ITL_MS):
        assert 0 < metrics[key]["p50"] < 10_000, key
    assert metrics[K.THROUGHPUT] > 0 and metrics[K.ITEMS_PER_CALL] == 4 and metrics[K.NEW_TOKENS] == 8
    assert metrics[K.GENERATED_TOKENS_CHECKED] is True and "Paris" in metrics[K.SAMPLE_TEXT]


def test_tune_measures_vllm_plans_and_says_why_each_lost_or_won(tmp_path):
    js = tmp_path / "t.json"
    proc = accelab(
        "tune",
        "smollm2-135m",
        "--goal",
        "throughput",
        "--include",
        "baseline,vllm",
        "--max-batch",
        "1",  # one batch size a plan: what is asserted is each plan's reason, not the batch search
        "--new-tokens",
        "8",
        "--min-seconds",
        "0.5",
        "--db",
        str(tmp_path / "r.db"),
        "--json",
        str(js),
        "--out",
        str(tmp_path / "best.yaml"),
        check=False,
    )
    assert proc.returncode in (0, 3), proc.stdout + proc.stderr  # 3: no plan beat the baseline
    report = json.loads(js.read_text())
    verdicts = report["verdicts"]
    vllm_keys = [k for k in verdicts if k.startswith("vllm")]
    assert any(k.startswith("vllm@") for k in vllm_keys), verdicts  # measured, not pruned
    for key in vllm_keys:  # each says why it won or lost, in the search's own words, with its figures
        why = verdicts[key]
        assert re.fullmatch(REASONS, why), (key, why)
        if m := re.match(r"slower \(([\d.e+]+) vs ([\d.e+]+) ", why):
            assert float(m[1]) < float(m[2]), why  # slower means a smaller throughput than the winner's
    assert ("winner" in verdicts.values()) and any(k.startswith("baseline@") for k in verdicts)
    assert "vllm" in proc.stdout


# what the search says of a candidate that ran and passed its quality check (accelab.tuner.search):
# it won, or lost on speed with the figures; an error, an unsupported plan or a failed quality
# check would not match
REASONS = (
    r"winner|(runner-up|tie with the winner) \(.+\)|slower \(.+ vs .+\)|batch \d+ was faster \(.+\)"
    r"|no gain over batch \d+ \(.+\)"
)


def test_the_default_generate_space_searches_vllm_plans():
    from accelab.catalog.resolve import resolve
    from accelab.tuner.space import search_space

    space = search_space(resolve("smollm2-135m", fetch=False), "generate", "cpu", max_batch=4)
    assert {"vllm", "vllm-bf16", "vllm-compiled"} <= set(space.variants) | set(space.pruned), space
    assert "vllm" in space.variants, space.pruned.get("vllm")  # runnable here: .venv-vllm is installed
