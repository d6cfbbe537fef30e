"""accelab bench, compare and verify end to end on real catalog models, through the real CLI."""

import json
import subprocess
import sys

import pytest

from accelab.results.store import Store

pytestmark = pytest.mark.slow


def accelab(*args, env=None, check=True):
    proc = subprocess.run(
        [sys.executable, "-m", "accelab", *args], capture_output=True, text=True, timeout=900, env=env, check=False
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"accelab {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


QUICK = ["--warmup", "1", "--min-iters", "3", "--min-seconds", "0.5"]


@pytest.mark.alone  # beside the other worker's load every round is noisy and dropped
def test_bench_minilm_forward(tmp_path):
    out, db = tmp_path / "m.json", tmp_path / "r.db"
    proc = accelab(
        "bench", "minilm-l6", "--batch-size", "4", "--seq-len", "64", *QUICK, "--json", str(out), "--db", str(db)
    )
    result = json.loads(out.read_text())
    m = result["metrics"]
    assert result["status"] == "ok"
    assert result["workload"]["batch_size"] == 4 and result["workload"]["seq_len"] == 64
    assert m["latency_ms"]["n"] == m["iterations"] >= 3
    assert m["latency_ms"]["p50"] <= m["latency_ms"]["p99"]
    # throughput is items over the wall time of the timed loop, not over one call's latency
    assert m["throughput"] == pytest.approx(4 * m["iterations"] / m["timed_seconds"])
    # MiniLM-L6 (hidden 384, FFN 1536, 6 layers) over 4 x 64 tokens, 2 FLOPs per multiply-add:
    # the encoder's linears, its attention (QK^T and AV) and the pooler's one 384x384 linear
    tokens, linears = 4 * 64, 6 * (4 * 384 * 384 + 2 * 384 * 1536)
    attention = 6 * 2 * (2 * 4 * 64 * 64 * 384)
    assert m["flops_per_call"] == 2 * linears * tokens + attention + 2 * 4 * 384 * 384
    assert m["achieved_flops"] == pytest.approx(m["flops_per_call"] / (m["latency_ms"]["p50"] / 1000))
    assert m["mfu"] == pytest.approx(m["achieved_flops"] / m["hardware"]["peak_flops"])
    # the peak is the best of the kernels models run, measured again if a run beats it: never above 100%
    assert 0 < m["mfu"] <= 1.0 and m["hardware"]["compute_path"] == "fp32" and "mfu_unknown" not in m
    assert m["peak_memory_mb"] > 100
    assert result["fingerprint"] and result["environment"]["versions"]["torch"]
    assert result["command"].startswith("accelab bench minilm-l6 "), result["command"]
    stored = Store(db).get(result["run_id"])
    assert stored.metrics["throughput"] == m["throughput"]
    assert "latency" in proc.stdout and "MFU" in proc.stdout


def test_bench_smollm2_generate_real_text(tmp_path):
    out = tmp_path / "s.json"
    accelab(
        "bench", "smollm2-135m", "--scenario", "generate", "--new-tokens", "8", *QUICK, "--json", str(out), "--no-store"
    )
    m = json.loads(out.read_text())["metrics"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert m[key]["p50"] > 0 and m[key]["p99"] >= m[key]["p50"]
    # ITL: 7 gaps per call (8 tokens), reset every call
    assert m["itl_ms"]["n"] == 7 * m["iterations"]
    assert m["decode_tokens_per_s"] == pytest.approx(1000 / m["tpot_ms"]["mean"], rel=0.05)
    assert m["roofline"]["bytes_per_step"] == m["weight_bytes"] > 400e6  # 135M params in fp32
    assert 0 < m["roofline"]["fraction"] <= 1.0 and "roofline_unknown" not in m
    assert "Paris" in m["sample_text"]  # the first prompt asks for the capital of France


def test_bad_input_errors_are_clear(tmp_path):
    proc = accelab("bench", "smollm2-13m", check=False)
    assert proc.returncode == 2 and "smollm2-135m" in proc.stderr
    proc = accelab("bench", "minilm-l6", "--seq-len", "100000", check=False)
    assert proc.returncode == 2 and "seq_len=100000" in proc.stderr and "1..512" in proc.stderr
    proc = accelab("bench", "minilm-l6", "--batch-size", "0", check=False)
    assert proc.returncode == 2 and "batch_size=0" in proc.stderr
    proc = accelab("bench", str(tmp_path / "nowhere"), check=False)
    assert proc.returncode == 2 and "nowhere" in proc.stderr
    proc = accelab("bench", "minilm-l6", "--plan", "compile-statc", check=False)
    assert proc.returncode == 2 and "compile-static" in proc.stderr
    proc = accelab("bench", "minilm-l6", "--set", "precison=bf16-autocast", check=False)
    assert proc.returncode == 2 and "did you mean 'precision'" in proc.stderr


def test_compare_tiny_model_rows_and_verdicts(tmp_path):
    out, md = tmp_path / "c.json", tmp_path / "c.md"
    proc = accelab(
        "compare",
        "vit-tiny",
        "--batch-size",
        "8",
        "--plans",
        "baseline,fp16-autocast,bf16-autocast,channels-last,baseline[threads=1]",
        *QUICK,
        "--json",
        str(out),
        "--markdown",
        str(md),
        "--no-store",
    )
    assert "baseline[threads=1]" in proc.stdout  # the printed table names the variant (no markup eats it)
    rows = {r["plan"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["baseline"]["speedup"] == 1.0 and rows["baseline"]["quality"] == "pass"
    assert rows["fp16-autocast"]["status"] == "unsupported" and "no-op on CPU" in rows["fp16-autocast"]["notes"]
    assert rows["fp16-autocast"]["speedup"] is None  # never a "1.0x" for a technique that did nothing
    bf16 = rows["bf16-autocast"]
    # the default 128 images: bf16 flipped 1 top-1 here, and 127 of 128 still show top-1 >= 0.957
    assert bf16["status"] == "ok" and bf16["quality"] == "pass", bf16
    assert bf16["quality_metrics"]["top1_agreement"] >= 127 / 128
    low, high = bf16["quality_intervals"]["top1_agreement"]
    assert 0.95 <= low < bf16["quality_metrics"]["top1_agreement"] <= high <= 1
    assert rows["channels-last"]["status"] == "unsupported"  # a ViT has one convolution
    assert rows["baseline[threads=1]"]["status"] == "ok"
    assert "| baseline |" in md.read_text()


def test_compare_exits_1_when_a_plan_breaks(tmp_path):
    # a run that breaks (here: past its --timeout) is a failure, unlike an "unsupported" row
    out = tmp_path / "c.json"
    proc = accelab(
        "compare",
        "vit-tiny",
        "--plans",
        "baseline",
        "--no-quality",
        "--timeout",
        "0.5",
        *QUICK,
        "--json",
        str(out),
        "--no-store",
        check=False,
    )
    assert proc.returncode == 1
    assert "1 of 1 plans did not run to the end: baseline" in proc.stderr
    assert json.loads(out.read_text())["rows"][0]["status"] == "timeout"  # written before the exit


def test_verify_a_convnet_against_its_reference(tmp_path):
    # the fp32 reference of a model without attention layers keeps its default attention
    out = tmp_path / "r.json"
    accelab(
        "verify",
        "resnet-50",
        "--plan",
        "channels-last",
        "--samples",
        "4",
        "--batch-size",
        "4",
        "--json",
        str(out),
        "--no-store",
    )
    result = json.loads(out.read_text())
    assert result["status"] == "ok" and result["quality"]["metrics"]["top1_agreement"] == 1.0
    # 4 of 4 images agreeing only show top-1 >= 0.51: no verdict yet, and 73 images would give one
    quality = result["quality"]
    assert quality["verdict"] == "cannot tell" and quality["possible"] == ["pass", "warn", "fail"]
    assert quality["samples_needed"] == 73


def fault_env(fault: str) -> dict[str, str]:
    """Children that break every plan's weights on purpose (tests/faults/sitecustomize.py)."""
    import os
    from pathlib import Path

    faults = str(Path(__file__).parent / "faults")
    return {
        **os.environ,
        "ACCELAB_TEST_FAULT": fault,
        "PYTHONPATH": os.pathsep.join(filter(None, [faults, os.environ.get("PYTHONPATH")])),
    }


def test_verify_detects_a_corrupted_plan(tmp_path):
    good = tmp_path / "good.json"
    accelab("verify", "minilm-l6", "--plan", "baseline", "--samples", "16", "--json", str(good), "--no-store")
    quality = json.loads(good.read_text())["quality"]
    assert quality["verdict"] == "pass" and quality["metrics"]["cosine_min"] > 0.9999
    bad = tmp_path / "bad.json"
    env = fault_env("perturb-weights:0.5")  # a deliberately broken plan (tests/faults)
    proc = accelab(
        "verify",
        "minilm-l6",
        "--plan",
        "baseline",
        "--samples",
        "16",
        "--json",
        str(bad),
        "--no-store",
        env=env,
        check=False,
    )
    assert proc.returncode == 1
    quality = json.loads(bad.read_text())["quality"]
    assert quality["verdict"] == "fail" and quality["metrics"]["cosine_min"] < 0.95
