"""The fidelity metrics and the verdict, on hand-computed cases (pure: numpy only)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from accelab.quality import metrics
from accelab.quality.verdict import Rule, judge, rules_for


def test_classification_top1_top5_logit_error_and_accuracy():
    ref = {"logits": np.array([[5.0, 1, 0, 0, 0, 0], [0, 4, 3, 2, 1, 0], [1, 2, 3, 4, 5, 6]]), "labels": [0, 2, 5]}
    cand = {"logits": np.array([[5.0, 1, 0, 0, 0, 0], [0, 3, 4, 2, 1, 0], [1, 2, 3, 4, 5, 6.6]])}
    m = metrics.classification(ref, cand)
    assert m["top1_agreement"] == pytest.approx(2 / 3)  # row 1 flips 1 -> 2
    assert m["top5_overlap"] == pytest.approx(1.0)  # the same five classes in every row, reordered
    # largest relative error: row 1, |(0,-1,1,0,0,0)| / |(0,4,3,2,1,0)| = sqrt(2) / sqrt(30)
    assert m["logit_rel_error"] == pytest.approx(math.sqrt(2 / 30))
    assert m["accuracy_ref"] == pytest.approx(2 / 3) and m["accuracy"] == pytest.approx(1.0)
    assert m["accuracy_change"] == pytest.approx(1 / 3)


def test_top5_overlap_counts_shared_classes():
    ref = {"logits": np.array([[9.0, 8, 7, 6, 5, 4, 3]])}  # top 5: 0..4
    cand = {"logits": np.array([[9.0, 8, 7, 1, 1, 4, 3]])}  # top 5: 0, 1, 2, 5, 6
    assert metrics.classification(ref, cand)["top5_overlap"] == pytest.approx(3 / 5)


def test_embeddings_cosine():
    ref = {"embeddings": np.array([[1.0, 0], [1, 1]])}
    cand = {"embeddings": np.array([[1.0, 0], [1, 0]])}
    m = metrics.embeddings(ref, cand)
    assert m["cosine_min"] == pytest.approx(1 / math.sqrt(2)) and m["cosine_mean"] == pytest.approx(
        (1 + 1 / math.sqrt(2)) / 2
    )
    assert m["max_abs_diff"] == pytest.approx(1.0)


def test_generation_agreements_first_divergence_and_perplexity():
    ref = {"tokens": np.array([[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]), "nll": math.log(10.0), "nll_tokens": 100}
    cand = {"tokens": np.array([[1, 2, 3, 4], [5, 0, 7, 8], [0, 9, 9, 9]]), "nll": math.log(11.0), "nll_tokens": 100}
    m = metrics.generation(ref, cand)
    assert m["token_agreement"] == pytest.approx(10 / 12)  # two of twelve positions differ
    assert m["prefix_agreement"] == pytest.approx((4 / 4 + 1 / 4 + 0 / 4) / 3)  # prefixes 4, 1, 0
    assert m["first_divergence_min"] == 0 and m["exact_match_rate"] == pytest.approx(1 / 3)
    assert m["perplexity_ref"] == pytest.approx(10.0) and m["perplexity_change"] == pytest.approx(0.1)
    same = metrics.generation(ref, {"tokens": ref["tokens"]})
    assert same["first_divergence_min"] is None and same["exact_match_rate"] == 1.0 and "perplexity" not in same


def test_shapes_must_match():
    with pytest.raises(ValueError, match=r"generated tokens differ in shape: reference \(1, 4\), candidate \(1, 3\)"):
        metrics.generation({"tokens": np.zeros((1, 4))}, {"tokens": np.zeros((1, 3))})


def test_a_rule_passes_warns_and_fails_at_its_two_thresholds():
    higher = Rule(metric="cosine_min", direction=">=", passing=0.99, warning=0.95)
    assert [higher.judge(v) for v in (0.99, 0.98, 0.95, 0.9499)] == ["pass", "warn", "warn", "fail"]
    lower = Rule(metric="perplexity_change", direction="<=", passing=0.03, warning=0.10)
    assert [lower.judge(v) for v in (0.03, 0.05, 0.10, 0.11)] == ["pass", "warn", "warn", "fail"]


def test_generation_verdict_takes_token_agreement_and_the_worst_rule():
    good = {"perplexity_change": 0.01, "prefix_agreement": 0.8, "token_agreement": 0.9}
    assert judge("text-generation", good)[0] == "pass"
    # perplexity and prefix pass, but after the divergences nothing matches: token agreement fails
    scrambled = {**good, "token_agreement": 0.2}
    verdict, lines = judge("text-generation", scrambled)
    assert verdict == "fail" and "token_agreement=0.2 fail (pass >= 0.6)" in lines
    assert judge("text-generation", {**good, "perplexity_change": 0.05})[0] == "warn"
    assert judge("text-generation", {**good, "token_agreement": None})[0] == "pass"  # unmeasured: not judged
    assert judge("text-generation", good, "strict")[0] == "warn"  # each rule within strict's warn band
    assert (
        judge(
            "text-generation",
            {**good, "prefix_agreement": 0.95, "token_agreement": 0.97, "perplexity_change": 0.001},
            "strict",
        )[0]
        == "pass"
    )


def test_tolerance_overrides_and_their_errors():
    rules = {r.metric: r for r in rules_for("feature-extraction", "balanced,cosine_min=0.995")}
    assert (rules["cosine_min"].passing, rules["cosine_min"].warning) == (0.995, 0.995)  # no warn band
    assert rules_for("feature-extraction", "cosine_min=0.9")[0].passing == 0.9  # level defaults to balanced
    with pytest.raises(ValueError, match="'medium' is not one of strict, balanced, loose"):
        rules_for("feature-extraction", "medium")
    with pytest.raises(
        ValueError, match="top1_agreement=... is not a rule for feature-extraction; rules are: cosine_min"
    ):
        rules_for("feature-extraction", "top1_agreement=0.9")
    with pytest.raises(ValueError, match="needs a number"):
        rules_for("feature-extraction", "cosine_min=high")
