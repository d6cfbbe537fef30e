"""The fidelity figures, their intervals and the verdict, on hand-computed cases and known
distributions (pure: numpy and scipy, milliseconds)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from accelab.quality import intervals, metrics
from accelab.quality.verdict import Rule, judge, label, rules_for, tune_exclusion
from accelab.results.result import Result


# -- intervals -------------------------------------------------------------------------------------
def test_the_bootstrap_interval_of_a_mean_covers_it_at_about_the_nominal_rate():
    """400 samples of 32 skewed values (exponential, mean 1, like per-window KL divergences):
    the expanded percentile interval covers the true mean about 95% of the time."""
    rng = np.random.default_rng(1)
    covered = [
        (iv.low <= 1.0 <= iv.high)
        for iv in (intervals.mean_interval(rng.exponential(1.0, 32), resamples=400, seed=i) for i in range(400))
    ]
    assert 0.91 <= np.mean(covered) <= 0.98


def test_the_expanded_percentile_is_wider_than_the_plain_one_for_small_samples():
    assert intervals.expanded_tail(32) == pytest.approx(0.0191, abs=5e-4)  # 1.9% / 98.1% at n = 32
    assert intervals.expanded_tail(10_000) == pytest.approx(0.025, abs=2e-4)  # the plain 2.5% for large n


def test_the_wilson_interval_matches_its_formula_and_covers_a_known_share():
    everyone = intervals.wilson(16, 16)  # 16 of 16 agree: only >= 0.806 is shown
    assert (everyone.value, everyone.high) == (1.0, 1.0) and everyone.low == pytest.approx(0.8063, abs=1e-4)
    assert intervals.wilson(128, 128).low == pytest.approx(0.9709, abs=1e-4)
    rng = np.random.default_rng(2)
    hits = rng.binomial(50, 0.9, size=2000)
    covered = [(iv.low <= 0.9 <= iv.high) for iv in (intervals.wilson(int(h), 50) for h in hits)]
    assert 0.93 <= np.mean(covered) <= 0.97


def test_a_pooled_percentile_resamples_whole_windows():
    kl = np.tile(np.arange(100.0), (20, 1))  # every window holds 0..99: the 99th percentile cannot move
    iv = metrics.pooled_percentile(kl, 99)
    assert iv.value == pytest.approx(98.01) and iv.low == pytest.approx(98.01) and iv.high == pytest.approx(98.01)


def test_the_samples_that_would_tell_grow_as_the_square_of_the_half_width():
    iv = intervals.Interval(value=0.008, low=0.006, high=0.010)  # 32 windows, line 0.009: half-width 2x the gap
    assert intervals.samples_to_tell(iv, 0.009, 32) == 128
    assert intervals.samples_to_tell(intervals.Interval(value=0.009, low=0.008, high=0.01), 0.009, 32) is None


# -- KL over top-k buckets -----------------------------------------------------------------------
def _logprobs(p: list[float]) -> np.ndarray:
    return np.log(np.asarray(p, dtype=np.float64))


def test_token_kl_is_the_exact_kl_when_the_lists_hold_the_whole_vocabulary():
    p, q = [0.5, 0.3, 0.15, 0.05], [0.4, 0.4, 0.1, 0.1]
    order_p, order_q = np.argsort(p)[::-1], np.argsort(q, kind="stable")[::-1]
    kl = metrics.token_kl(
        order_p[None, None], _logprobs(p)[order_p][None, None], order_q[None, None], _logprobs(q)[order_q][None, None]
    )
    exact = sum(a * math.log(a / b) for a, b in zip(p, q))
    assert kl.shape == (1, 1) and kl[0, 0] == pytest.approx(exact)


def test_token_kl_merges_the_ids_outside_both_lists_into_one_bucket_and_stays_below_the_full_kl():
    p, q = [0.5, 0.3, 0.15, 0.05], [0.4, 0.4, 0.1, 0.1]
    # the reference's top 2 are ids 0, 1; the candidate's are 1, 0: buckets {0}, {1}, {2, 3}
    kl = metrics.token_kl(
        np.array([[[0, 1]]]), _logprobs(p[:2])[None, None], np.array([[[1, 0]]]), _logprobs([0.4, 0.4])[None, None]
    )
    bucketed = 0.5 * math.log(0.5 / 0.4) + 0.3 * math.log(0.3 / 0.4) + 0.2 * math.log(0.2 / 0.2)
    assert kl[0, 0] == pytest.approx(bucketed)
    assert kl[0, 0] < sum(a * math.log(a / b) for a, b in zip(p, q))
    # only id 0 in both lists (the candidate's top 2 are 0 and 2): buckets {0}, {1, 2, 3}
    only = metrics.token_kl(
        np.array([[[0, 1]]]), _logprobs(p[:2])[None, None], np.array([[[0, 2]]]), _logprobs([0.4, 0.1])[None, None]
    )
    assert only[0, 0] == pytest.approx(0.5 * math.log(0.5 / 0.4) + 0.5 * math.log(0.5 / 0.6))


def _windows(rng: np.random.Generator, w: int, shift: float) -> tuple[dict, dict]:
    """W windows of 8 positions over a vocabulary of 6 (lists hold all of it); the candidate's
    logits are the reference's plus `shift` noise."""
    logits = rng.normal(size=(w, 8, 6))
    cand_logits = logits + shift * rng.normal(size=logits.shape)

    def side(x: np.ndarray) -> dict:
        lp = x - np.log(np.exp(x).sum(-1, keepdims=True))
        ids = np.argsort(-lp, axis=-1)
        return {
            "top_ids": ids,
            "top_logprobs": np.take_along_axis(lp, ids, -1),
            "target_logprobs": lp[..., 0],  # the text's token: id 0
            "windows_digest": "same",
            "scoring": {"window_tokens": 12, "windows_per_sample": 2, "candidate_topk": "top-6 of full logits"},
        }

    return side(logits), side(cand_logits)


def test_generation_figures_come_with_intervals_over_windows():
    ref, cand = _windows(np.random.default_rng(3), 40, 0.3)
    ref["tokens"], cand["tokens"] = np.array([[1, 2, 3, 4]]), np.array([[1, 2, 0, 4]])
    figures = metrics.generation(ref, cand)
    m, iv = figures["metrics"], figures["intervals"]
    assert m["token_agreement"] == 0.75 and m["prefix_agreement"] == 0.5  # greedy: reported
    assert set(iv) == {"mean_kl", "p99_kl", "top1_agreement", "perplexity_ratio"}
    for name in iv:
        assert iv[name][0] <= m[name] <= iv[name][1], name
    assert 0 < m["mean_kl"] < m["p99_kl"] and 0.5 < m["top1_agreement"] < 1
    assert m["perplexity_ratio"] == pytest.approx(m["perplexity"] / m["perplexity_ref"])
    assert figures["sample"] == {
        "unit": "windows",
        "n": 40,
        "per_sample": 2,
        "positions": 320,
        "method": "bootstrap over windows",
        "kl_over": "ids in the reference's top-6 and the candidate's top-6 of full logits, plus one bucket for "
        "the rest",
        "window": "12 tokens, the last 8 scored",
    }
    same = metrics.generation(ref, ref)["metrics"]
    assert same["mean_kl"] == pytest.approx(0, abs=1e-12) and same["top1_agreement"] == 1.0
    assert same["perplexity_ratio"] == pytest.approx(1.0)


def test_generation_refuses_windows_of_another_text():
    ref, cand = _windows(np.random.default_rng(4), 4, 0.1)
    cand["windows_digest"] = "other"
    with pytest.raises(ValueError, match="scored different text windows"):
        metrics.generation(ref, cand)


def test_classification_figures_and_their_intervals():
    ref = {"logits": np.array([[5.0, 1, 0, 0, 0, 0], [0, 4, 3, 2, 1, 0], [1, 2, 3, 4, 5, 6]]), "labels": [0, 2, 5]}
    cand = {"logits": np.array([[5.0, 1, 0, 0, 0, 0], [0, 3, 4, 2, 1, 0], [1, 2, 3, 4, 5, 6.6]])}
    figures = metrics.classification(ref, cand)
    m, iv = figures["metrics"], figures["intervals"]
    assert m["top1_agreement"] == pytest.approx(2 / 3)  # row 1 flips 1 -> 2
    assert iv["top1_agreement"] == pytest.approx([0.2077, 0.9385], abs=1e-4)  # Wilson, 2 of 3
    assert m["top5_overlap"] == pytest.approx(1.0) and iv["top5_overlap"] == [1.0, 1.0]  # same five classes
    # largest relative error: row 1, |(0,-1,1,0,0,0)| / |(0,4,3,2,1,0)| = sqrt(2) / sqrt(30)
    assert m["logit_rel_error"] == pytest.approx(math.sqrt(2 / 30))
    assert m["accuracy_ref"] == pytest.approx(2 / 3) and m["accuracy"] == pytest.approx(1.0)
    assert m["accuracy_change"] == pytest.approx(1 / 3) and iv["accuracy_change"][1] == pytest.approx(1.0)
    assert figures["sample"]["unit"] == "images" and figures["sample"]["n"] == 3


def test_embedding_figures_judge_the_mean_cosine_and_report_the_minimum():
    ref = {"embeddings": np.array([[1.0, 0], [1, 1]])}
    cand = {"embeddings": np.array([[1.0, 0], [1, 0]])}
    m = metrics.embeddings(ref, cand)["metrics"]
    assert m["cosine_min"] == pytest.approx(1 / math.sqrt(2))
    assert m["cosine_mean"] == pytest.approx((1 + 1 / math.sqrt(2)) / 2) and m["max_abs_diff"] == pytest.approx(1.0)


def test_shapes_must_match():
    with pytest.raises(ValueError, match=r"generated tokens differ in shape: reference \(1, 4\), candidate \(1, 3\)"):
        metrics.greedy({"tokens": np.zeros((1, 4))}, {"tokens": np.zeros((1, 3))})


# -- the verdict ----------------------------------------------------------------------------------
def _figures(**rows: tuple[float, float, float]) -> dict:
    return {
        "metrics": {k: v for k, (v, _, _) in rows.items()},
        "intervals": {k: [lo, hi] for k, (_, lo, hi) in rows.items()},
        "sample": {"unit": "windows", "n": 32, "per_sample": 2},
    }


GOOD = {"top1_agreement": (0.97, 0.96, 0.98), "perplexity_ratio": (1.003, 1.001, 1.005)}


def test_a_rule_judges_an_interval_by_the_outcomes_at_its_two_ends():
    rule = Rule(metric="mean_kl", direction="<=", passing=0.005, warning=0.015)
    iv = intervals.Interval
    assert rule.outcomes(iv(value=0.003, low=0.002, high=0.005)) == ("pass", "pass")  # the line itself passes
    assert rule.outcomes(iv(value=0.01, low=0.008, high=0.012)) == ("warn", "warn")
    assert rule.outcomes(iv(value=0.004, low=0.003, high=0.006)) == ("pass", "warn")
    assert rule.outcomes(iv(value=0.01, low=0.004, high=0.02)) == ("pass", "fail")
    assert rule.outcomes(iv(value=0.03, low=0.02, high=0.04)) == ("fail", "fail")


def test_pass_when_every_interval_is_inside_its_line():
    result = judge("text-generation", _figures(mean_kl=(0.003, 0.0028, 0.0033), **GOOD))
    assert (result.verdict, result.possible, result.samples_needed) == ("pass", ("pass",), None)
    assert result.lines[0] == "mean_kl=0.003 (0.0028-0.0033) pass (pass <= 0.005, warn <= 0.015)"


def test_fail_when_an_interval_is_clear_of_the_warn_line_whatever_the_others_say():
    figures = _figures(
        mean_kl=(0.025, 0.021, 0.027), top1_agreement=(0.94, 0.91, 0.96), perplexity_ratio=(1.0, 0.99, 1.01)
    )
    result = judge("text-generation", figures)
    assert result.verdict == "fail" and result.possible == ("fail",)
    assert result.lines[0] == "mean_kl=0.025 (0.021-0.027) fail (pass <= 0.005, warn <= 0.015)"
    assert result.lines[1].startswith("top1_agreement=0.94 (0.91-0.96) cannot tell: pass, warn or fail")


def test_cannot_tell_when_an_interval_straddles_a_line_and_how_many_samples_would_tell():
    figures = _figures(mean_kl=(0.004, 0.003, 0.006), **GOOD)  # straddles the pass line 0.005
    result = judge("text-generation", figures)
    assert result.verdict == "cannot tell" and result.possible == ("pass", "warn")
    # half-width 0.002 toward the line at distance 0.001: 4x the windows, 128 = --samples 64
    assert result.samples_needed == 64
    assert "about 128 windows (--samples 64) would tell" in result.lines[0]
    assert label(result.to_dict()) == "cannot tell (pass or warn)"
    on_line = judge("text-generation", _figures(mean_kl=(0.005, 0.004, 0.006), **GOOD))
    assert on_line.verdict == "cannot tell" and on_line.samples_needed is None
    assert "no sample size tells" in on_line.lines[0]


def test_warn_when_an_interval_lies_between_the_lines_and_unmeasured_figures_are_not_judged():
    assert judge("text-generation", _figures(mean_kl=(0.01, 0.008, 0.012), **GOOD)).verdict == "warn"
    assert judge("text-generation", _figures(mean_kl=(0.003, 0.002, 0.004))).verdict == "pass"
    nothing = judge("text-generation", {"metrics": {"token_agreement": 0.1}})  # greedy: reported, never judged
    assert nothing.verdict == "cannot tell" and nothing.lines == ("no figure its rules judge was measured",)


def test_a_classifier_with_every_image_agreeing_passes_only_with_enough_images():
    def figures(n: int) -> dict:
        agree = intervals.wilson(n, n)
        return {
            "metrics": {"top1_agreement": 1.0},
            "intervals": {"top1_agreement": [agree.low, agree.high]},
            "sample": {"unit": "images", "n": n, "per_sample": 1, "wilson": ["top1_agreement"]},
        }

    assert judge("image-classification", figures(128)).verdict == "pass"
    few = judge("image-classification", figures(16))
    assert few.verdict == "cannot tell" and few.possible == ("pass", "warn", "fail")
    # 73 images tell: the smallest n with n / (n + 1.96^2) >= 0.95 (Wilson at a share of 1)
    assert few.samples_needed == 73 and "about 73 images (--samples 73) would tell" in few.lines[0]
    assert intervals.wilson(73, 73).low >= 0.95 > intervals.wilson(72, 72).low


def test_tolerance_overrides_and_their_errors():
    rules = {r.metric: r for r in rules_for("feature-extraction", "balanced,cosine_mean=0.995")}
    assert (rules["cosine_mean"].passing, rules["cosine_mean"].warning) == (0.995, 0.995)  # no warn band
    assert rules_for("text-generation", "mean_kl=0.002")[0].passing == 0.002  # level defaults to balanced
    with pytest.raises(ValueError, match="'medium' is not one of strict, balanced, loose"):
        rules_for("feature-extraction", "medium")
    with pytest.raises(
        ValueError, match="top1_agreement=... is not a rule for feature-extraction; rules are: cosine_mean"
    ):
        rules_for("feature-extraction", "top1_agreement=0.9")
    with pytest.raises(ValueError, match="needs a number"):
        rules_for("feature-extraction", "cosine_mean=high")


def test_tune_keeps_only_what_its_check_has_shown_acceptable():
    assert tune_exclusion("pass", "balanced") is None and tune_exclusion(None, "balanced") is None
    assert tune_exclusion("warn", "balanced") is None and tune_exclusion("warn", "strict") == "quality warned (strict)"
    assert tune_exclusion("fail", "loose") == "quality failed" and tune_exclusion("fail", "off") is None
    assert tune_exclusion("cannot tell (pass or warn)", "balanced") is None
    assert (
        tune_exclusion("cannot tell (pass or warn)", "strict")
        == "quality cannot tell (pass or warn): it may warn (strict)"
    )
    assert tune_exclusion("cannot tell (warn or fail)", "balanced") == (
        "quality cannot tell (warn or fail): it may fail (balanced)"
    )


# -- what the tables show -------------------------------------------------------------------------
def _verify_result(quality: dict) -> Result:
    return Result(
        kind="verify",
        status="ok",
        model={"name": "smollm2-135m", "task": "text-generation"},
        plan={"name": "int8-bf16"},
        workload={"scenario": "verify", "samples": 16},
        metrics={"throughput": 10.0},
        quality=quality,
    )


def test_verify_and_compare_tables_show_the_figures_with_their_intervals_and_what_would_tell():
    from rich.console import Console

    from accelab.quality.verify import judge_outputs
    from accelab.results import compare_table
    from accelab.results.table import print_verify

    ref, cand = _windows(np.random.default_rng(5), 32, 0.12)
    kl = metrics.generation(ref, cand)
    line = (kl["metrics"]["mean_kl"] + kl["intervals"]["mean_kl"][1]) / 2  # inside the interval, off its estimate
    tolerance = f"mean_kl={line:.6f},top1_agreement=0,perplexity_ratio=100"  # only the KL can decide
    quality = judge_outputs("text-generation", ref, cand, tolerance)
    assert quality["verdict"] == "cannot tell" and quality["label"] == "cannot tell (pass or fail)"
    assert quality["source"].startswith("llama.cpp's scoreboard") and quality["samples_needed"] > 16
    low, high = quality["intervals"]["mean_kl"]

    console = Console(record=True, width=220)
    print_verify(_verify_result(quality), console=console)
    text = console.export_text()
    assert f"cannot tell (pass or fail) ({tolerance}); about --samples {quality['samples_needed']} would" in text
    assert "32 windows of the evaluation text (12 tokens, the last 8 scored: 256 positions)" in text
    assert f"({low:.4g}-{high:.4g})" in text and "lines from" in text

    [row] = compare_table.rows([_verify_result(quality)])
    assert row["quality"] == "cannot tell" and row["quality_intervals"]["mean_kl"] == [low, high]
    assert row["quality_figure"].startswith("cannot tell (pass or fail) · mean_kl ")
    assert f"about --samples {quality['samples_needed']} would tell" in row["notes"]
    assert row["quality_figure"] in compare_table.to_markdown([_verify_result(quality)])
