"""The regression rule (pure, milliseconds): thresholds, noise, directions, pairing, machines.

Results here are SYNTHETIC (tests/test_report_helpers.py); the real-bench check of the same rule
is tests/test_report_e2e.py."""

import pytest
from test_report_helpers import ENV, OTHER_ENV, OTHER_FINGERPRINT, bench, train

from accelab.report.pairing import machine_differences
from accelab.report.regress import Thresholds, compare, judge


def verdicts(comparison, pair=0):
    return {c.metric: c.verdict for c in comparison.pairs[pair].checks}


# -- judge: one metric --------------------------------------------------------------------------
def test_judge_within_threshold_is_ok():
    change, limit, verdict, _ = judge(100, 103, better="lower", threshold=0.05, spreads=(0.01, 0.01))
    assert verdict == "ok" and change == pytest.approx(0.03) and limit == pytest.approx(0.05)


def test_judge_beyond_threshold_but_within_noise_passes_as_noise():
    # cv 10 % each: noise = 2 * sqrt(0.01 + 0.01) = 28.3 %; a 20 % move is within it
    _, limit, verdict, why = judge(100, 120, better="lower", threshold=0.05, spreads=(0.1, 0.1))
    assert verdict == "noise" and limit == pytest.approx(0.2828, abs=1e-3) and "noise" in why


def test_judge_beyond_threshold_and_noise_is_a_regression():
    _, _, verdict, _ = judge(100, 140, better="lower", threshold=0.05, spreads=(0.1, 0.1))
    assert verdict == "REGRESSION"


def test_judge_direction_for_throughput_and_improvements():
    assert judge(100, 80, better="higher", threshold=0.05)[2] == "REGRESSION"
    assert judge(100, 120, better="higher", threshold=0.05)[2] == "improved"
    assert judge(100, 80, better="lower", threshold=0.05)[2] == "improved"


def test_judge_noise_factor_scales_the_limit():
    assert judge(100, 115, better="lower", threshold=0.05, spreads=(0.05, 0.05), noise_factor=1.0)[2] == "REGRESSION"
    assert judge(100, 115, better="lower", threshold=0.05, spreads=(0.05, 0.05), noise_factor=3.0)[2] == "noise"


def test_judge_zero_baseline_has_no_relative_change():
    assert judge(0, 5, better="lower", threshold=0.05)[2] == "-"


# -- compare: whole runs -----------------------------------------------------------------------
def test_repeated_runs_pass():
    comparison = compare([bench(p50=100, cv=0.03)], [bench(p50=102, cv=0.03, memory=510)])
    assert not comparison.regressed
    assert set(verdicts(comparison).values()) <= {"ok", "noise"}
    assert {"p50", "p99", "throughput", "peak memory"} <= set(verdicts(comparison))


def test_slowed_run_fails_on_latency_and_throughput():
    comparison = compare([bench(p50=100, cv=0.03)], [bench(p50=180, cv=0.03)])
    v = verdicts(comparison)
    assert comparison.regressed
    assert v["p50"] == v["p99"] == v["throughput"] == "REGRESSION"
    p50 = next(c for c in comparison.pairs[0].checks if c.metric == "p50")
    assert p50.change == pytest.approx(0.8) and p50.baseline == 100 and p50.candidate == 180


def test_noisy_runs_do_not_fail_on_a_move_within_their_noise():
    comparison = compare([bench(p50=100, cv=0.3, tail=1.0)], [bench(p50=125, cv=0.3, tail=1.0)])
    assert not comparison.regressed
    assert verdicts(comparison)["p50"] == "noise"


def test_p99_is_judged_against_the_tail_width():
    # same p50, a stall doubles the candidate's tail: within 2 x combined tail width (0.1, 0.9)
    base, cand = bench(p50=100, tail=0.1), bench(p50=100, tail=0.9)
    assert verdicts(compare([base], [cand]))["p99"] == "noise"
    # a uniform 40 % slowdown with narrow tails is a p99 regression
    assert verdicts(compare([bench(p50=100, tail=0.1)], [bench(p50=140, tail=0.1)]))["p99"] == "REGRESSION"


def test_memory_has_its_own_threshold():
    assert verdicts(compare([bench(memory=500)], [bench(memory=540)]))["peak memory"] == "ok"  # +8 % < 10 %
    assert verdicts(compare([bench(memory=500)], [bench(memory=560)]))["peak memory"] == "REGRESSION"  # +12 %
    strict = Thresholds(memory=0.05)
    assert verdicts(compare([bench(memory=500)], [bench(memory=540)], strict))["peak memory"] == "REGRESSION"


@pytest.mark.parametrize(
    "base,cand,expected",
    [
        ("pass", "fail", "REGRESSION"),
        ("pass", "warn", "REGRESSION"),
        ("warn", "fail", "REGRESSION"),
        ("warn", "pass", "improved"),
        ("pass", "pass", "ok"),
    ],
)
def test_quality_verdict_getting_worse_is_a_regression(base, cand, expected):
    comparison = compare([bench(quality=base)], [bench(quality=cand)])
    assert verdicts(comparison)["quality"] == expected
    assert comparison.regressed == (expected == "REGRESSION")


def test_unverified_candidate_is_reported_not_failed():
    comparison = compare([bench(quality="pass")], [bench()])
    assert verdicts(comparison)["quality"] == "-" and not comparison.regressed


def test_candidate_that_did_not_run_is_a_regression():
    failed = bench(status="oom", reason="CUDA out of memory", metrics={})
    comparison = compare([bench()], [failed])
    assert comparison.regressed and verdicts(comparison) == {"status": "REGRESSION"}


def test_failed_baseline_compares_nothing_and_says_so():
    comparison = compare([bench(status="error", reason="boom", metrics={})], [bench()])
    assert comparison.compared == 0 and not comparison.regressed
    assert "nothing to compare against" in comparison.pairs[0].warnings[0]


def test_few_calls_warn_that_the_noise_estimate_is_rough():
    comparison = compare([bench(n=3)], [bench(n=20)])
    assert any("only 3 calls" in w for w in comparison.pairs[0].warnings)


def test_generate_runs_check_e2e_ttft_and_tpot():
    def gen(p50, **kw):
        r = bench(p50=p50, **kw)
        r.workload["scenario"] = "generate"
        r.metrics = {
            "e2e_ms": r.metrics["latency_ms"],
            "ttft_ms": {**r.metrics["latency_ms"], "p50": p50 / 10},
            "tpot_ms": {**r.metrics["latency_ms"], "p50": p50 / 40},
            "throughput": 1000 / p50,
            "throughput_unit": "tokens/s",
            "peak_memory_mb": 700.0,
        }
        return r

    comparison = compare([gen(400)], [gen(600)])
    v = verdicts(comparison)
    assert v["e2e p50"] == v["TTFT p50"] == v["TPOT p50"] == v["throughput"] == "REGRESSION"
    assert next(c.unit for c in comparison.pairs[0].checks if c.metric == "throughput") == "tokens/s"


# -- like with like ----------------------------------------------------------------------------
def test_different_machines_are_refused_unless_allowed():
    other = bench(environment=OTHER_ENV, fingerprint=OTHER_FINGERPRINT)
    with pytest.raises(ValueError, match="results from different machines are not compared as equals") as err:
        compare([bench()], [other])
    assert "cpu_model" in str(err.value) and "torch 2.13.0+cpu -> 2.9.0" in str(err.value)
    assert "--allow-different-machines" in str(err.value)
    comparison = compare([bench()], [other], allow_different_machines=True)
    assert comparison.warnings[0].startswith("WARNING: results from different machines are not compared as equals")


def test_missing_fingerprint_warns():
    comparison = compare([bench(fingerprint="")], [bench()])
    assert "fingerprint is missing" in comparison.warnings[0]


def test_a_single_pair_must_be_the_same_model_and_workload():
    with pytest.raises(ValueError, match="different workloads .*batch_size 8 -> 1"):
        compare([bench(batch=8)], [bench(batch=1)])
    with pytest.raises(ValueError, match="same model"):
        compare([bench()], [bench(model="vit-tiny")])


def test_a_single_pair_may_change_the_plan_and_lists_what_changed():
    slow = bench(p50=150)
    slow.plan = {**slow.plan, "threads": 1}
    comparison = compare([bench(p50=100)], [slow])
    assert "plans differ: threads 2 -> 1" in comparison.pairs[0].warnings
    assert comparison.regressed


def test_groups_are_paired_by_model_plan_and_workload():
    base = [bench(plan="baseline", p50=100), bench(plan="compile", p50=60)]
    cand = [bench(plan="compile", p50=90), bench(plan="baseline", p50=101), bench(plan="int8", p50=50)]
    comparison = compare(base, cand)
    by_label = {p.label.split(" · ")[1]: p for p in comparison.pairs}
    assert set(by_label) == {"baseline", "compile"}
    assert not by_label["baseline"].regressed and by_label["compile"].regressed
    assert comparison.only_candidate == ("minilm-l6 · int8 · forward · batch 8 · seq 128",)
    assert any("only in the candidate" in w for w in comparison.warnings)


def test_newest_run_per_key_wins_within_a_tag():
    old = bench(p50=50, created="2026-10-01T00:00:00+00:00")
    new = bench(p50=100, created="2026-11-01T00:00:00+00:00")
    other = bench(plan="compile")
    comparison = compare([old, new, other], [bench(p50=101), bench(plan="compile")])
    pair = next(p for p in comparison.pairs if "baseline" in p.label)
    assert pair.baseline_id == new.run_id and not pair.regressed


def test_groups_with_nothing_in_common_are_refused():
    with pytest.raises(ValueError, match="no baseline run matches"):
        compare([bench(plan="a"), bench(plan="b")], [bench(plan="c"), bench(plan="d")])


def test_empty_side_is_refused():
    with pytest.raises(ValueError, match="candidate has no runs"):
        compare([bench()], [])


def test_thresholds_out_of_range_are_refused():
    with pytest.raises(ValueError, match="out of range"):
        Thresholds(latency=-0.1)


def test_environment_differences_name_the_fields():
    assert machine_differences(ENV, ENV) == []
    diffs = machine_differences(ENV, OTHER_ENV)
    assert "torch 2.13.0+cpu -> 2.9.0" in diffs and any(d.startswith("cpu_model") for d in diffs)


def test_train_runs_check_step_time_samples_per_s_epoch_time_and_memory():
    v = verdicts(compare([train(speed=1.0)], [train(speed=0.7)]))
    assert v == {"step p50": "REGRESSION", "samples/s": "REGRESSION", "epoch time": "REGRESSION", "peak memory": "ok"}
    assert not compare([train(speed=1.0)], [train(speed=1.02)]).regressed


# -- the machine's noise: the statistics of compare and tune ------------------------------------------
def with_rounds(result, rates, used=None, level="quiet", reason=""):
    """SYNTHETIC: the rounds and noise record a bench child and its driver write."""
    used = used or [True] * len(rates)
    result.metrics["rounds"] = [
        {"rate": r, "seconds": 1.0, "calls": 10, "cv": 0.02, "used": u, "level": "quiet" if u else "unreliable"}
        for r, u in zip(rates, used)
    ]
    result.metrics["noise"] = {"level": level, "reason": reason, "rounds": len(rates), "rounds_used": sum(used)}
    return result


def check(comparison, metric):
    return next(c for c in comparison.pairs[0].checks if c.metric == metric)


def test_a_run_measured_under_noise_is_unreliable_never_a_regression():
    base = with_rounds(bench(p50=100), [80.0, 80.5, 79.5])
    cand = with_rounds(
        bench(p50=200), [40.0, 80.0, 41.0], used=[False, False, False], level="unreliable", reason="31% CPU steal"
    )
    comparison = compare([base], [cand])
    assert not comparison.regressed
    assert {verdicts(comparison)[m] for m in ("p50", "p99", "throughput")} == {"unreliable"}
    assert verdicts(comparison)["peak memory"] == "ok"  # memory does not depend on the neighbours
    assert check(comparison, "p50").why == (
        "the candidate ran under noise (31% CPU steal; 0 of 3 rounds quiet enough): rerun it on a quieter machine"
    )


def test_throughput_by_the_quiet_rounds_of_both_runs():
    base = with_rounds(bench(p50=100), [80.0, 80.5, 79.5, 80.2])
    # the pooled figure says 18% slower (a busy round); the quiet rounds say the same speed
    same = with_rounds(bench(p50=100, batch=8), [40.0, 80.1, 79.9, 80.4], used=[False, True, True, True], level="quiet")
    same.metrics["throughput"] = 80.0 * 0.82
    t = check(compare([base], [same]), "throughput")
    assert t.verdict == "ok" and t.why.startswith("rounds: no measurable difference")
    slower = with_rounds(bench(p50=100), [60.0, 61.0, 59.5, 60.5])
    t = check(compare([base], [slower]), "throughput")
    assert t.verdict == "REGRESSION" and t.change == pytest.approx(60.25 / 80.05 - 1, abs=2e-3)
    assert t.why.startswith("rounds: 0.75x (slower; 95% CI")
    faster = with_rounds(bench(p50=100), [100.0, 101.0, 99.0, 100.5])
    assert check(compare([base], [faster]), "throughput").verdict == "improved"
    wide = with_rounds(bench(p50=100), [55.0, 95.0, 57.0, 93.0])  # 0.91x, but its interval is 0.56-1.46
    assert check(compare([base], [wide]), "throughput").verdict == "noise"
