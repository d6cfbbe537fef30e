"""The teacher-forced windows and the cached reference, with a fake tokenizer, a fake language
model, a fake engine and a fake child runner (no real model: milliseconds)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from accelab.backends import engine_wire as W
from accelab.catalog.spec import ModelSpec
from accelab.measure.runner import ChildOutcome
from accelab.plan.plan import Plan
from accelab.plan.runtime import Runnable
from accelab.quality import verify, windows
from accelab.quality.collect import DEFAULT_SAMPLES, QualityConfig, config_for

VOCAB = 50


class WordTokenizer:
    """Each word of the text is one token, its id a stable function of the word."""

    def __call__(self, text: str, **_: object) -> dict:
        return {"input_ids": [sum(map(ord, word)) % VOCAB for word in text.split()]}


def fake_logits(ids: torch.Tensor) -> torch.Tensor:
    """[B, S] -> [B, S, V]: a fixed function of each token and its predecessor."""
    prev = torch.roll(ids, 1, dims=-1)
    v = torch.arange(VOCAB, dtype=torch.float32)
    return torch.sin(ids[..., None].float() * 0.37 * v + prev[..., None].float() * 0.11) * 3


class FakeLM:
    calls: list = []

    def __call__(self, input_ids: torch.Tensor, **_: object) -> SimpleNamespace:
        self.calls.append(tuple(input_ids.shape))
        return SimpleNamespace(logits=fake_logits(input_ids))


class FakeEngine:
    """An engine process's answer to Score(top_k): the same logits, scored on its side."""

    def score_top(self, ids: list[int], top_k: int) -> W.Scored:
        lp = torch.log_softmax(fake_logits(torch.tensor([ids]))[0, :-1], -1)
        top = lp.topk(top_k, -1)
        return W.Scored(
            id="1",
            logprobs=[float(lp[i, t]) for i, t in enumerate(ids[1:])],
            top_ids=top.indices.tolist(),
            top_logprobs=top.values.tolist(),
        )


def runnable(model: object) -> Runnable:
    return Runnable(
        model=model, processor=WordTokenizer(), device=torch.device("cpu"), task="text-generation", plan=Plan(name="x")
    )


def test_windows_are_the_same_on_every_run_and_a_larger_sample_keeps_the_smaller_ones():
    small = windows.text_windows(WordTokenizer(), 8, 16)
    large = windows.text_windows(WordTokenizer(), 32, 16)
    assert small.shape == (8, 16) and large.shape == (32, 16)
    assert np.array_equal(small, large[:8])  # nested: more samples refine, never replace
    assert np.array_equal(small, windows.text_windows(WordTokenizer(), 8, 16))
    assert windows.digest(small, 4) == windows.digest(large[:8], 4) != windows.digest(small, 5)
    with pytest.raises(ValueError, match="pass fewer --samples"):
        windows.text_windows(WordTokenizer(), 10**6, 16)


def test_scoring_keeps_the_top_k_and_the_texts_own_token_after_the_context():
    chosen = windows.text_windows(WordTokenizer(), 5, 12)
    FakeLM.calls = []
    scores = windows.score_windows(runnable(FakeLM()), chosen, context_tokens=4, top_k=6, batch_size=2)
    assert FakeLM.calls == [(2, 12)] * 3  # the short last batch is filled up: one shape for compiled plans
    assert scores["top_ids"].shape == scores["top_logprobs"].shape == (5, 8, 6)
    assert scores["target_logprobs"].shape == (5, 8)
    lp = torch.log_softmax(fake_logits(torch.from_numpy(chosen)), -1).numpy()  # [W, L, V]
    # position 4 of window 2 is predicted from what precedes it: logits of position 3
    assert scores["target_logprobs"][2, 0] == pytest.approx(lp[2, 3, chosen[2, 4]], abs=1e-5)
    assert list(scores["top_ids"][2, 0]) == list(np.argsort(-lp[2, 3])[:6])  # the likeliest first
    assert np.all(np.diff(scores["top_logprobs"], axis=-1) <= 0)
    assert scores["candidate_topk"] == "top-6 of full logits"


def test_an_engine_scores_the_same_positions_as_full_logits():
    chosen = windows.text_windows(WordTokenizer(), 3, 12)
    full = windows.score_windows(runnable(FakeLM()), chosen, context_tokens=4, top_k=6, batch_size=8)
    engine = windows.score_windows(runnable(FakeEngine()), chosen, context_tokens=4, top_k=6, batch_size=8)
    for key in ("top_ids", "top_logprobs", "target_logprobs"):
        np.testing.assert_allclose(engine[key], full[key], atol=1e-5)
    assert engine["candidate_topk"] == "top-6 (torch engine)"


def test_the_config_scales_the_windows_with_the_samples_and_checks_its_fields():
    assert QualityConfig(samples=16).windows == 32 and QualityConfig(samples=64).windows == 128
    assert config_for("image-classification").samples == DEFAULT_SAMPLES["image-classification"] == 128
    assert config_for("text-generation", 48, new_tokens=8) == QualityConfig(samples=48, new_tokens=8)
    with pytest.raises(ValueError, match="context_tokens=128 must be 1 to window_tokens - 1"):
        QualityConfig(context_tokens=128)
    with pytest.raises(ValueError, match="samples=0 must be 1 or more"):
        QualityConfig(samples=0)


def test_the_reference_is_computed_once_and_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELAB_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    spec = ModelSpec(name="m", task="image-classification", source=str(model))
    runs = []

    def fake_run(job):
        runs.append(job.payload)
        outputs = {"logits": np.arange(6.0).reshape(2, 3)}
        return ChildOutcome(status="ok", value=verify.CollectOutput(status="ok", outputs=outputs))

    monkeypatch.setattr(verify, "run_isolated", fake_run)
    config = QualityConfig(samples=2)
    first = verify.reference_outputs(spec, config)
    second = verify.reference_outputs(spec, config)
    assert len(runs) == 1 and runs[0].plan.name == verify.REFERENCE_PLAN.name
    np.testing.assert_array_equal(first["logits"], second["logits"])
    verify.reference_outputs(spec, QualityConfig(samples=3))  # another sample: another reference
    assert len(runs) == 2
    (model / "config.json").write_text('{"changed": true}')  # the model's files changed: computed again
    verify.reference_outputs(spec, config)
    assert len(runs) == 3
