"""The convergence verdict and time-to-target (accelab.train.convergence) on synthetic loss curves:
exponential decays with per-step noise and a per-seed rate, from seeded generators, at one or
several global batches. Pure: milliseconds."""

from __future__ import annotations

import math

import numpy as np
import pytest

from accelab.train.convergence import (
    FLOOR,
    Band,
    Curve,
    Eval,
    judge,
    target_score,
    time_to_target,
)
from accelab.train.eval_interval import eval_difference

RUN_SAMPLES = 6400  # every synthetic run sees this many samples
START, END = 2.3, 0.2  # loss at sample 0 and its asymptote (ln 10: ten classes)
T_975_DF2 = 4.302652729749464  # Student's t, 97.5% quantile, 2 degrees of freedom (tables)
Z_975 = 1.959963984540054
LIKE, SLOWER, DIVERGES = "converges like the baseline", "slower to converge", "diverges"


def decay(seed: int, *, rate: float = 1.0, batch: int = 32) -> list[float]:
    """START -> END with 3 time constants per run at rate 1 (95% of the drop); the seed moves the
    rate by ~3% and draws per-step noise whose spread falls as sqrt(batch), as a batch mean's does."""
    rng = np.random.default_rng(seed)
    samples = np.arange(1, RUN_SAMPLES // batch + 1) * batch
    seed_rate = rate * (1 + 0.03 * rng.normal())
    noise = 0.05 * math.sqrt(32 / batch) * rng.normal(size=samples.size)
    return (END + (START - END) * np.exp(-3 * seed_rate * samples / RUN_SAMPLES) + noise).tolist()


@pytest.fixture(scope="module")
def baselines() -> list[Curve]:
    return [Curve.of(decay(seed), 32) for seed in (0, 1)]


@pytest.fixture(scope="module")
def band(baselines) -> Band:
    return Band.of(baselines)


def test_a_copy_or_a_fresh_seed_of_the_baseline_converges_like_it(baselines, band):
    copy = judge(baselines[0], band)
    assert copy.label == LIKE and copy.late_share_above == 0.0
    assert copy.band_low < copy.loss < copy.band_high  # type: ignore[operator]
    assert copy.reason.endswith("; above the band at 0% of the late part")
    # other seeds stray above the band now and then (2 seeds give a rough band), never for most of the late part
    fresh = [judge(Curve.of(decay(seed), 32), band) for seed in range(2, 10)]
    assert [v.label for v in fresh] == [LIKE] * 8


def test_half_the_decay_rate_is_slower_at_any_batch(band):
    for batch in (32, 128):
        verdict = judge(Curve.of(decay(7, rate=0.5, batch=batch), batch), band)
        assert verdict.label == SLOWER
        assert verdict.late_share_above == 1.0 and verdict.loss > verdict.band_high  # type: ignore[operator]
        assert verdict.samples == RUN_SAMPLES
        assert verdict.reason.startswith(f"loss {verdict.loss:#.3g} at 6,400 samples, band ")
        assert verdict.reason.endswith("; above the band at 100% of the late part (rule: 50%)")


def test_the_same_rate_at_four_times_the_batch_converges_like_the_baseline(band):
    # compared on samples seen: 50 steps at 128 cover what 200 steps at 32 do
    assert judge(Curve.of(decay(3, batch=128), 128), band).label == LIKE


def test_a_faster_curve_is_below_the_band_and_no_fault(band):
    verdict = judge(Curve.of(decay(4, rate=2.0), 32), band)
    assert verdict.label == LIKE and verdict.loss < verdict.band_low  # type: ignore[operator]
    assert verdict.reason.endswith("below the band: learns faster")


def test_a_rising_curve_does_not_learn(band):
    rising = START + np.linspace(0, 0.5, 200) + 0.05 * np.random.default_rng(5).normal(size=200)
    verdict = judge(Curve.of(rising.tolist(), 32), band)
    assert verdict.label == DIVERGES and verdict.reason.startswith("no learning: smoothed loss 2.8")


def test_a_flat_curve_is_far_above_the_band(band):
    # it ends a hair below its start (this noise draw), so "no learning" does not fire: the drop rule does
    flat = START + 0.05 * np.random.default_rng(6).normal(size=200)
    verdict = judge(Curve.of(flat.tolist(), 32), band)
    assert verdict.label == DIVERGES
    assert verdict.reason.startswith("far above the band: loss 2.31 at 6,400 samples, band 0.278-0.336, more than 50%")


def test_a_too_high_learning_rate_that_falls_then_jumps_to_chance_is_far_above_the_band(band):
    # the usual fault: a few good steps, then the weights blow up and the loss sits near ln 10
    losses = decay(8)[:20] + [2.0 + 0.02 * math.sin(i) for i in range(180)]  # 2.3 -> 1.8, then 2.0
    verdict = judge(Curve.of(losses, 32), band)
    assert verdict.label == DIVERGES
    assert verdict.reason.startswith("far above the band: loss 2.00 at 6,400 samples, band 0.")
    assert "of the baseline's drop" in verdict.reason


def test_a_nan_loss_diverges_at_its_step(baselines, band):
    losses = list(baselines[0].losses)
    losses[119] = float("nan")
    verdict = judge(Curve.of(losses, 32), band)
    assert verdict.label == DIVERGES and verdict.loss is None and verdict.samples == 120 * 32
    assert verdict.reason == "loss nan at step 120 (3,840 samples): training diverged"


def test_two_equal_seeds_get_the_floor_not_a_zero_width_band():
    seed = Curve.of(decay(0), 32)
    band = Band.of([seed, Curve.of([x + 1e-9 for x in seed.losses], 32)])
    center, half = np.asarray(band.center), (np.asarray(band.high) - np.asarray(band.low)) / 2
    assert half == pytest.approx(FLOOR * center, rel=1e-6)
    assert band.seeds == 2 and len(band.grid) == 50 and band.grid[0] == 32 and band.grid[-1] == RUN_SAMPLES


def test_one_seed_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="got 1 seed.*run the baseline with 2 or more seeds"):
        Band.of([Curve.of(decay(0), 32)])


def test_a_plan_that_ran_a_fraction_of_the_baseline_is_refused(band):
    with pytest.raises(ValueError, match="train the plan for as many samples as the baseline"):
        judge(Curve.of(decay(0)[:3], 32), band)


def test_the_eval_interval_adds_seed_spread_and_binomial_sampling():
    seeds = [0.90, 0.91, 0.92]  # stdev 0.01
    same = eval_difference(0.91, seeds, eval_samples=360, higher_is_better=True)
    p = (0.91 * 360 + 1) / 362
    half = math.hypot(T_975_DF2 * 0.01 * math.sqrt(4 / 3), Z_975 * math.sqrt(2 * p * (1 - p) / 360))
    assert same.difference == pytest.approx(0.0, abs=1e-12)
    assert (same.low, same.high) == (pytest.approx(-half), pytest.approx(half))
    assert same.verdict == "no measurable difference" and same.low < 0 < same.high
    worse = eval_difference(0.70, seeds, eval_samples=360, higher_is_better=True)
    assert worse.verdict == "worse" and worse.high < 0
    assert worse.reason.startswith("-0.210 vs the baseline's 0.910 (95% interval -0.285 to -0.135, ")
    assert worse.reason.endswith("from 3 seeds' spread and 360 eval samples): worse")


def test_the_eval_interval_of_a_loss_is_the_seed_spread_and_lower_is_better():
    seeds = [0.30, 0.31, 0.32]
    half = T_975_DF2 * 0.01 * math.sqrt(4 / 3)
    seed_like = eval_difference(0.33, seeds, eval_samples=None, higher_is_better=False)
    assert seed_like.high - seed_like.low == pytest.approx(2 * half) and seed_like.verdict == "no measurable difference"
    assert eval_difference(0.60, seeds, eval_samples=None, higher_is_better=False).verdict == "worse"
    assert eval_difference(0.20, seeds, eval_samples=None, higher_is_better=False).verdict == "better"
    with pytest.raises(ValueError, match="got 1 score.*run 2 or more seeds"):
        eval_difference(0.3, [0.3], eval_samples=None, higher_is_better=False)


def evals(*points: tuple[float, float]) -> list[dict]:
    """(wall_s, accuracy) pairs as the worker records them, one eval every 10 steps."""
    return [
        {"step": 10 * (i + 1), "wall_s": wall, "accuracy": acc, "loss": 1 - acc, "perplexity": None, "samples": 360}
        for i, (wall, acc) in enumerate(points)
    ]


def test_time_to_target_interpolates_between_the_evals_around_it():
    run = Curve.of([1.0], 32, evals((10.0, 0.5), (20.0, 0.8), (30.0, 0.95)))
    assert time_to_target(run.evals, 0.9, "accuracy") == pytest.approx(20 + 10 * 0.1 / 0.15)
    assert time_to_target(run.evals, 0.4, "accuracy") == 10.0  # the first eval already has it
    assert time_to_target(run.evals, 0.99, "accuracy") is None  # never reached
    # loss 0.5, 0.2, 0.05: lower is better
    assert time_to_target(run.evals, 0.1, "loss") == pytest.approx(20 + 10 * 0.1 / 0.15)


def test_the_target_is_the_baseline_seeds_mean_final_score():
    seeds = [Curve.of([1.0], 32, evals((10.0, 0.5), (20.0, acc))) for acc in (0.90, 0.92)]
    assert target_score(seeds, "accuracy") == pytest.approx(0.91)
    assert target_score(seeds, "loss") == pytest.approx(0.09)
    with pytest.raises(ValueError, match="recorded no perplexity; pick one it has: accuracy | loss"):
        target_score(seeds, "perplexity")
    with pytest.raises(ValueError, match="lacks wall_s"):
        Eval.of({"step": 10, "loss": 0.5})
