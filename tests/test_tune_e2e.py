"""accelab tune end to end on a small real model: plan file, resume from the store, limits."""

import json
import subprocess
import sys

import pytest
import yaml

pytestmark = pytest.mark.slow


def accelab(*args, check=True):
    proc = subprocess.run(
        [sys.executable, "-m", "accelab", *args], capture_output=True, text=True, timeout=900, check=False
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"accelab {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


# one searchable plan (fp16 autocast is pruned on CPU) and batches 2..4 keep this to a few children
COMMON = [
    "vit-tiny",
    "--include",
    "baseline,fp16-autocast",
    "--batch-size",
    "2",
    "--max-batch",
    "4",
    "--min-seconds",
    "0.5",
]


def test_tune_writes_plan_resumes_and_reproduces(tmp_path):
    db, out, plot, js = tmp_path / "r.db", tmp_path / "best.yaml", tmp_path / "p.png", tmp_path / "t.json"
    proc = accelab(
        "tune", *COMMON, "--quality", "off", "--db", str(db), "--out", str(out), "--plot", str(plot), "--json", str(js)
    )
    report = json.loads(js.read_text())
    plan = yaml.safe_load(out.read_text())
    variant, batch = report["winner"].split("@")
    assert plan["batch_size"] == int(batch) and variant == "baseline" and plan["precision"] == "fp32"
    assert report["pruned"]["fp16-autocast"].startswith("accelerate's fp16 autocast is a no-op")
    assert report["verdicts"][report["winner"]] == "winner"
    assert "every plan tried" in proc.stdout and plot.stat().st_size > 10_000
    # every measurement is in the store; a second run resumes from it without measuring again
    again = json.loads((tmp_path / "t.json").read_text())
    proc2 = accelab("tune", *COMMON, "--quality", "off", "--db", str(db), "--out", str(out), "--json", str(js))
    resumed = json.loads(js.read_text())
    assert "resuming tune" in proc2.stdout
    assert resumed["reused"] == len(again["run_ids"]) and resumed["winner"] == again["winner"]
    # the plan file is accepted by bench
    bench = tmp_path / "b.json"
    accelab("bench", "vit-tiny", "--plan", str(out), "--min-seconds", "0.5", "--json", str(bench), "--no-store")
    assert json.loads(bench.read_text())["workload"]["batch_size"] == int(batch)


def test_tune_impossible_limit_says_which(tmp_path):
    proc = accelab(
        "tune",
        *COMMON,
        "--quality",
        "off",
        "--max-memory",
        "10MiB",
        "--db",
        str(tmp_path / "r.db"),
        "--out",
        str(tmp_path / "b.yaml"),
        check=False,
    )
    assert proc.returncode == 3
    assert "no plan met every limit" in proc.stdout and "memory limit (10 MB)" in proc.stdout
    assert not (tmp_path / "b.yaml").exists()
