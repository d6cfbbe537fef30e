"""backend openvino generating with OpenVINO GenAI end to end on SmolLM2 (the real engine from
.venv-openvino): compare against the torch baseline with quality verdicts (fp32 gives the
reference's greedy tokens), verify int8 weights against the fp32 reference, and one export per
model and weight format. Its engines are its own (tests/engines.py) and stop at its end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from engines import own_runtime_dir
from tiny_models import tiny_smollm2

from accelab import cpu
from accelab.catalog import inputs
from accelab.catalog.fetch import is_fetched

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not is_fetched("smollm2-135m"), reason="run `accelab models fetch smollm2-135m` first"),
]

ENV: dict[str, str] = {}  # the commands' environment: engine_env
QUICK = ["--warmup", "1", "--min-iters", "3", "--min-seconds", "0.5"]


def accelab(*args):
    proc = subprocess.run(
        [sys.executable, "-m", "accelab", *args], capture_output=True, text=True, timeout=1200, env=ENV, check=False
    )
    if proc.returncode != 0:
        raise AssertionError(f"accelab {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module", autouse=True)
def engine_env():
    with own_runtime_dir() as env:
        ENV.update(env, ACCELAB_OPENVINO_KEEP_S="120")  # a leftover engine leaves by itself
        yield
        ENV.clear()


# not `alone`: what it asserts is no speed (rows that ran, quality verdicts, notes), and run first in the
# alone block its two exports (~3 min, one core) left the other core idle on a fresh machine
def test_compare_gives_rows_with_verdicts(tmp_path):
    out = tmp_path / "c.json"
    args = ["compare", "smollm2-135m", "--scenario", "generate", "--plans", "baseline,openvino,openvino-int8"]
    accelab(*args, "--new-tokens", "8", "--samples", "4", "--rounds", "2", *QUICK, "--json", str(out), "--no-store")
    rows = {r["plan"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["baseline", "openvino", "openvino-int8"]
    verdicts = ("pass", "warn", "fail", "cannot tell")
    assert all(r["status"] == "ok" and r["quality"] in verdicts for r in rows.values()), rows
    fp32 = rows["openvino"]
    assert fp32["quality"] == "pass"  # fp32 weights, f32 inference and KV cache: the reference's distributions
    assert fp32["quality_metrics"]["token_agreement"] >= 0.9 and fp32["quality_metrics"]["mean_kl"] < 1e-3
    assert "OpenVINO GenAI" in fp32["notes"] and "fp32 weights, inference f32, KV cache f32" in fp32["notes"]
    assert "int8 weights" in rows["openvino-int8"]["notes"]


def test_verify_int8_reports_the_kl_divergence_from_the_engines_top_k(tmp_path):
    out = tmp_path / "v.json"
    accelab("verify", "smollm2-135m", "--plan", "openvino-int8", "--json", str(out), "--no-store")
    quality = json.loads(out.read_text())["quality"]
    m = quality["metrics"]
    # judged by the same rules as every plan, not assumed
    assert quality["verdict"] in ("pass", "warn", "cannot tell")
    assert 0.3 <= m["token_agreement"] <= 1.0 and 5 < m["perplexity_ref"] < 100
    # the engine's own graph scores the text at int8, and returns its top-64 per position
    assert abs(m["perplexity_ratio"] - 1) < 0.05 and 0 < m["mean_kl"] < 0.015
    assert "top-64 (openvino engine)" in quality["sample"]["kl_over"]


def test_an_export_happens_once_per_model_and_weight_format(tmp_path, monkeypatch, capsys):
    """In a cache of its own (the fetched models linked in), the first call exports with a progress
    line; the second reuses the folder. A two-layer SmolLM2 stands in (the exporter's own start-up
    is most of its 27 s; SmolLM2's export takes ~100 s and is made by the test above)."""
    from accelab.backends import openvino_genai
    from accelab.catalog.resolve import resolve
    from accelab.catalog.store import model_dir
    from accelab.paths import models_dir

    tiny = tiny_smollm2(tmp_path / "tiny-smollm2", model_dir("smollm2-135m"))
    spec = resolve(str(tiny), fetch=False)
    (tmp_path / "models").symlink_to(models_dir())
    monkeypatch.setenv("ACCELAB_CACHE", str(tmp_path))
    install, reason = openvino_genai.find_genai()
    assert install is not None, reason
    first = openvino_genai.exported(spec, "int8", install)
    assert f"exporting {tiny} to OpenVINO with int8 weights" in capsys.readouterr().err
    assert (first / "openvino_model.xml").is_file() and first.is_relative_to(tmp_path / "openvino-genai")
    assert openvino_genai.exported(spec, "int8", install) == first
    assert "exporting" not in capsys.readouterr().err
    assert not [p for p in first.parent.iterdir() if p.name.startswith(".tmp-")]  # no half export left


def test_tune_for_serving_measures_the_openvino_server_with_its_engine_memory(tmp_path):
    """`tune --scenario serve` starts `accelab serve --plan openvino-int8-bf16` (openvino-int8 where
    bf16 is not native) beside the baseline, counts the engine process in its memory, and judges
    its quality with verify's rules. (Not alone: which plan wins is not asserted, so a second
    worker's load changes nothing here but the time.)"""
    plan = "openvino-int8-bf16" if cpu.native_bf16() else "openvino-int8"
    report = tmp_path / "tune.json"
    prompts = tmp_path / "prompts.txt"  # six prompts: the warm-up sends each once (52 by default)
    prompts.write_text("\n".join(inputs.prompts(6)))
    accelab(
        "tune", "smollm2-135m", "--scenario", "serve", "--include", f"baseline,{plan}", "--prompt-file", str(prompts),
        "--concurrency", "2", "--rounds", "1", "--window", "3", "--slo", "ttft_p99=30s", "--max-tokens", "16,32",
        "--out", str(tmp_path / "serve.yaml"), "--json", str(report), "--db", str(tmp_path / "r.db"),
    )  # fmt: skip
    summary = json.loads(report.read_text())
    [level] = summary["levels"]
    assert set(level["order"]) == {"baseline", plan}, level
    ov = summary["candidates"][plan]
    assert ov["quality"].startswith(("pass", "warn", "cannot tell"))
    assert ov["peak_rss_mb"] > 150  # the engine process holds the weights: counted with the server's


def test_the_default_generate_space_searches_openvino_plans():
    from accelab.catalog.resolve import resolve
    from accelab.tuner.space import search_space

    space = search_space(resolve("smollm2-135m", fetch=False), "generate", "cpu", max_batch=4)
    assert {"openvino", "openvino-int8", "openvino-int8-bf16"} <= set(space.variants), space.pruned
