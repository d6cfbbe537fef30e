"""`accelab tune --scenario serve`: candidate servers under the same closed-loop load, ranked by
goodput within the memory limit and the quality tolerance.

End to end (real `accelab serve` processes of SmolLM2, real load, a real SQLite store): a
candidate slowed on purpose (FAULT INJECTION, tests/faults: +150 ms a step) ranks last with
its goodput ratio, a candidate holding 3 GiB of ballast is left out for --max-memory with its
peak, the winner's Plan keeps the server settings it was measured with and `accelab serve`
takes them, and a second run resumes from the store without starting a server. The rest is the
ranking and the option parsing alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from accelab import cpu
from accelab.catalog import inputs
from accelab.catalog.fetch import is_fetched
from accelab.loadtest.summary import SLO
from accelab.plan.plan import Plan, load_plan
from accelab.results import contract as K
from accelab.serve.config import ServeConfig
from accelab.tuner.serve_rank import Candidate, rank
from accelab.tuner.serve_request import MAX_TOKENS_MIX, parse_levels, parse_max_tokens, parse_serve_slo

FAULTS = Path(__file__).parent / "faults"
MODEL = "smollm2-135m"
# two plans besides the baseline that run at this CPU's full speed (bf16 where it is native, else int8
# weights at float32 on the AVX2 operator): the end-to-end tune slows one and weighs down the other
NATIVE_PLANS = ("bf16", "int8-bf16") if cpu.native_bf16() else ("int8-weight", "int8-weight[quantize_head=true]")


# -- the ranking alone ------------------------------------------------------------------------------
def candidate(key: str, goodputs: list[float], **kwargs) -> Candidate:
    rows = {
        r: {K.GOODPUT_TOKEN_THROUGHPUT: g, K.OUTPUT_TOKEN_THROUGHPUT: g, K.ERRORS: 0} for r, g in enumerate(goodputs)
    }
    return Candidate(key=key, plan=Plan(name=key), windows={8: rows}, **kwargs)


def test_the_most_goodput_wins_and_every_other_candidate_says_why_it_lost():
    ranking = rank(
        [
            candidate("slow", [50.0, 60.0]),
            candidate("fast", [200.0, 180.0]),
            candidate("big", [400.0, 400.0], excluded="peak memory 3000 MiB over --max-memory 2GiB"),
            candidate("bad", [500.0, 500.0], excluded="quality failed: mean_kl=0.4 (0.3-0.5) fail"),
        ],
        8,
    )
    assert ranking.winner == "fast" and ranking.tie_with is None
    assert ranking.order == ["fast", "slow", "big", "bad"]
    assert ranking.why["slow"].startswith("goodput 55.0 tokens/s, 0.29x the winner's 190.0")
    assert "paired rounds 0.25, 0.33" in ranking.why["slow"]
    assert ranking.why["big"].startswith("peak memory") and ranking.why["bad"].startswith("quality failed")


def test_a_runner_up_within_three_percent_round_by_round_is_a_tie():
    ranking = rank([candidate("a", [100.0, 104.0]), candidate("b", [99.0, 102.0])], 8)
    assert ranking.winner == "a" and ranking.tie_with == "b"
    assert "a tie within the noise" in ranking.why["b"]


def test_no_winner_when_no_request_met_the_slo():
    ranking = rank([candidate("a", [0.0, 0.0]), candidate("b", [0.0, 0.0])], 8)
    assert ranking.winner is None and ranking.why == {"a": "no request met the SLO", "b": "no request met the SLO"}


def test_slo_and_levels_parse_with_clear_errors():
    assert parse_serve_slo("ttft_p99=500ms,itl_p99=100ms") == SLO(ttft=0.5, tpot=0.1)
    assert parse_serve_slo("e2e=2s") == SLO(e2e=2.0) and parse_serve_slo(None) == SLO()
    with pytest.raises(ValueError, match="must look like KEY=TIME"):
        parse_serve_slo("latency=1s")
    assert parse_levels("16,1,8") == (1, 8, 16)
    with pytest.raises(ValueError, match="whole numbers"):
        parse_levels("8 users")
    with pytest.raises(ValueError, match="1 or more users"):
        parse_levels("0")
    assert parse_max_tokens("16, 64") == (16, 64) and parse_max_tokens("32") == (32,)
    with pytest.raises(ValueError, match="whole numbers"):
        parse_max_tokens("long")
    with pytest.raises(ValueError, match="1 token or more"):
        parse_max_tokens("0,16")


def test_the_load_asks_for_the_max_tokens_given_or_chats_mix():
    from accelab.tuner.options import TuneOptions, serve_tune_request

    assert serve_tune_request(MODEL, TuneOptions(scenario="serve")).max_tokens == MAX_TOKENS_MIX
    asked = serve_tune_request(MODEL, TuneOptions(scenario="serve", max_tokens="16,32"))
    assert asked.max_tokens == (16, 32)


def test_a_plan_carries_server_settings_and_the_typed_options_win():
    plan = load_plan("bf16", ["server=max_batch_size:8;max_step_tokens:512"])
    assert Plan.from_yaml(plan.to_yaml()) == plan
    options = {"max_batch_size": 32, "max_step_tokens": None, "kv_cache_tokens": None}
    config = ServeConfig.from_options(options, model_name="m", plan_name="p", plan_settings=dict(plan.server))
    assert (config.max_batch_size, config.max_step_tokens) == (8, 512)
    typed = ServeConfig.from_options(
        {**options, "max_batch_size": 4}, model_name="m", plan_name="p", plan_settings=dict(plan.server),
        given=frozenset({"max_batch_size"}),
    )  # fmt: skip
    assert (typed.max_batch_size, typed.max_step_tokens) == (4, 512)
    with pytest.raises(ValueError, match="the server settings are: max_batch_size"):
        Plan(server=(("batch", 8),))
    with pytest.raises(ValueError, match="whole number"):
        load_plan("bf16", ["server=max_batch_size:many"])


def test_only_generation_models_are_tuned_for_serving():
    from accelab.catalog.resolve import resolve
    from accelab.tuner.serve_request import ServeTuneRequest

    with pytest.raises(ValueError, match="measures generation servers.*--scenario forward"):
        ServeTuneRequest(spec=resolve("minilm-l6", fetch=False), model="minilm-l6")


# -- end to end -------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.alone  # it ranks servers by their speed: beside a compiling neighbour 3 s windows saw 2-4 tokens/s
def test_tune_ranks_a_slowed_candidate_last_leaves_out_one_over_memory_and_resumes(tmp_path):
    if not is_fetched(MODEL):
        pytest.skip(f"run `accelab models fetch {MODEL}` first")
    slowed, heavy = NATIVE_PLANS  # plans the CPU runs at full speed: what they are does not matter here
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(FAULTS), os.environ.get("PYTHONPATH")])),
        "ACCELAB_TEST_FAULT": f"slow-serve:{slowed}:100,ballast-serve:{heavy}:3072",
    }
    out, report, db = tmp_path / "serve.yaml", tmp_path / "tune.json", tmp_path / "results.db"
    prompts = tmp_path / "prompts.txt"  # six prompts: the warm-up sends each once (52 by default)
    # answers of 16-32 tokens (chat's mix reaches 128): a window ends when its last answers do, and
    # the slowed server's take ~10 s, not ~40
    prompts.write_text("\n".join(inputs.prompts(6)))
    command = [
        sys.executable, "-m", "accelab", "tune", MODEL, "--scenario", "serve",
        "--include", f"baseline,{slowed},{heavy}", "--prompt-file", str(prompts),
        "--concurrency", "2", "--rounds", "2", "--window", "3", "--max-memory", "2500MiB", "--slo", "ttft_p99=30s",
        "--max-tokens", "16,32",
        "--out", str(out), "--json", str(report), "--db", str(db),
    ]  # fmt: skip
    first = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    summary = json.loads(report.read_text())
    [level] = summary["levels"]
    assert level["winner"] == "baseline" and level["order"][:2] == ["baseline", slowed]
    why = level["why"][slowed]
    assert why.startswith("goodput") and float(why.split(", ")[1].split("x")[0]) < 0.5, why
    assert "over --max-memory 2500MiB" in level["why"][heavy]
    assert summary["candidates"][heavy]["peak_rss_mb"] > 3072
    assert summary["candidates"]["baseline"]["peak_rss_mb"] < 2500
    assert summary["candidates"][slowed]["quality"].startswith("pass")  # verify's rules, balanced
    assert f"starting {heavy}" in first.stdout and "winner" in first.stdout

    plan_text = out.read_text()
    assert plan_text.startswith("# ") and "winner at 2 users: baseline" in plan_text
    plan = Plan.from_yaml(plan_text)
    assert dict(plan.server) == {"max_batch_size": 2, "max_step_tokens": 256}

    # the same tune again: every window and the exclusion come from the store, no server starts
    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-4000:]
    assert "windows measured before are reused" in again.stdout and "starting" not in again.stdout
    assert json.loads(report.read_text())["levels"][0]["winner"] == "baseline"

    # the winner's plan serves with the settings it was measured with
    from serving import ServerProcess

    server = ServerProcess("-m", "accelab", "serve", MODEL, "--plan", str(out), "--port", "0", timeout_s=300)
    try:
        server.wait_ready(300)
    finally:
        server.stop()
    log = "".join(server.log)
    assert "server settings of plan serve-tuned-baseline: max_batch_size=2, max_step_tokens=256" in log, log[-2000:]
    assert "up to 2 sequences, 256 tokens per step" in log, log[-2000:]  # what the scheduler was given


def test_accelab_serve_takes_a_plans_server_settings_unless_the_option_is_typed(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from accelab.cli import app
    from accelab.serve import server as serve_module

    configs = []
    monkeypatch.setattr(serve_module, "run_server", lambda config, factory, access_log=False: configs.append(config))
    plan = tmp_path / "serve.yaml"
    plan.write_text(load_plan("baseline", ["server=max_batch_size:2;max_step_tokens:300"]).to_yaml())
    runner = CliRunner()
    first = runner.invoke(app, ["serve", MODEL, "--plan", str(plan)])
    typed = runner.invoke(app, ["serve", MODEL, "--plan", str(plan), "--max-batch-size", "5"])
    assert first.exit_code == typed.exit_code == 0, first.output + typed.output
    assert [(c.max_batch_size, c.max_step_tokens) for c in configs] == [(2, 300), (5, 300)]
    assert "server settings of plan baseline+server=" in first.output + first.stderr


def test_the_table_names_plans_with_options_in_brackets_as_given():
    """rich reads `[...]` as markup: a plan such as llamacpp[llama_quant=q8_0] must print whole."""
    import io

    from rich.console import Console

    from accelab.catalog.resolve import resolve
    from accelab.tuner.serve_report import render
    from accelab.tuner.serving import ServeTuneOutcome, ServeTuneRequest

    key = "llamacpp[llama_quant=q8_0]"
    candidates = [candidate("baseline", [10.0, 10.0]), candidate(key, [20.0, 21.0])]
    outcome = ServeTuneOutcome(
        group="g", candidates={c.key: c for c in candidates}, pruned={"vllm-bf16[vllm_mode=compiled]": "no venv"},
        rankings=[rank(candidates, 8)],
    )  # fmt: skip
    console = Console(file=io.StringIO(), width=250)
    render(outcome, ServeTuneRequest(spec=resolve(MODEL, fetch=False), model=MODEL), console)
    printed = console.file.getvalue()
    assert key in printed and "vllm-bf16[vllm_mode=compiled]: no venv" in printed


# -- the candidates per CPU kind --------------------------------------------------------------------
AVX2_SLOW = {
    "bf16-weights": "measured bf16 matmul 21.0 GFLOP/s vs fp32 159.0: expect it slower",
    "int8-dynamic": "measured 0.07x fp32 eager on a transformer MLP here: expect it slower than fp32",
}


@pytest.mark.parametrize(
    ("kind", "slow", "bf16_wins"),
    [
        ("avx2", AVX2_SLOW, None),
        ("amx", {}, "bf16 weights measured 2.10x fp32 eager on a transformer MLP here"),
        ("avx2, int8 operator slow", {**AVX2_SLOW, "int8-gemm-f32": "measured 0.50x the float32 GEMMs"}, None),
    ],
)
def test_the_candidates_are_what_can_win_on_this_cpu_and_the_rest_say_why(monkeypatch, kind, slow, bf16_wins):
    """An AVX2-only CPU keeps the float32 plans (int8 weights on the AVX2 operator, OpenVINO's int8
    at f32) and leaves out what emulates bf16; an AMX CPU keeps bf16 and leaves out the float32
    twins of its int8 plans; the engine's int8 plans are judged by its own operator's probe, not
    by torchao's eager kernel. Every plan left out says why."""
    from accelab.catalog.resolve import resolve
    from accelab.tuner import serving

    monkeypatch.setattr(serving, "slow_here", lambda device: slow)
    monkeypatch.setattr(serving, "bf16_outruns_fp32", lambda device: bf16_wins)
    monkeypatch.setattr(serving, "check_supported", lambda plan, spec, device: None)  # every runtime installed
    request = serving.ServeTuneRequest(spec=resolve(MODEL, fetch=False), model=MODEL)
    chosen, pruned = serving.serve_space(request)
    keys = {c.key for c in chosen}
    assert keys | set(pruned) == set(serving.SERVE_CANDIDATES) and not keys & set(pruned)
    f32_int8 = {"int8-weight", "int8-weight[compile=default]", "int8-weight[compile=default;quantize_head=true]"}
    bf16 = {"bf16", "bf16[compile=default]", "vllm-bf16[vllm_mode=compiled]", "openvino-int8-bf16"}
    bf16 |= {"int8-bf16", "int8-bf16[compile=default]", "int8-bf16[compile=default;quantize_head=true]"}
    always = {"baseline", "compile", "llamacpp", "llamacpp[llama_quant=q8_0]", "vllm[vllm_mode=compiled]"}
    if kind == "avx2":
        assert keys == always | f32_int8 | {"openvino-int8"}
        assert all(pruned[k].startswith("measured bf16 matmul 21.0") for k in bf16)
    elif kind == "amx":
        assert keys == always | bf16
        assert pruned["int8-weight"].startswith("its bf16 twin serves int8 here: bf16 weights measured 2.10x")
        assert "openvino-int8" in pruned
    else:
        assert keys == always | {"openvino-int8"}
        assert pruned["int8-weight[compile=default]"].startswith("measured 0.50x the float32 GEMMs")
    assert all("--include" in why for why in pruned.values())


def test_the_engines_int8_plans_are_judged_by_its_own_operators():
    from accelab.tuner.serving import serve_techniques

    assert serve_techniques(load_plan("int8-weight")) == ["int8-gemm-f32"]
    assert serve_techniques(load_plan("int8-bf16[compile=default]")) == ["bf16-weights", "compile", "int8-gemm-bf16"]
    assert serve_techniques(load_plan("openvino-int8-bf16")) == ["openvino", "bf16-weights"]
