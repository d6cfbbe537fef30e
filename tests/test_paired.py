"""The speed-up statistics (accelab.measure.paired): the paired ratio of rounds, its Student-t
interval on the logs, Welch's unpaired interval, and the verdict rule. Hand-computed cases."""

from __future__ import annotations

import math

import pytest

from accelab.measure.paired import (
    check_overlap,
    judge,
    paired_ratio,
    relative_half_width,
    t_quantile,
    unpaired_ratio,
)

T_975_DF2 = 4.302652729749464  # Student's t, 97.5% quantile, 2 degrees of freedom (tables)
T_975_DF5 = 2.570581835636314


def test_t_quantiles_match_the_tables():
    assert t_quantile(0.975, 2) == pytest.approx(T_975_DF2, rel=1e-9)
    assert t_quantile(0.975, 5) == pytest.approx(T_975_DF5, rel=1e-9)


def test_identical_ratios_give_a_point_interval():
    ratio = paired_ratio([20.0, 40.0, 10.0], [10.0, 20.0, 5.0])
    assert ratio.value == pytest.approx(2.0) and ratio.low == pytest.approx(2.0) and ratio.high == pytest.approx(2.0)
    assert ratio.verdict == "faster" and ratio.rounds == 3 and ratio.dropped == 0
    assert ratio.reason == "2.00x (faster; 95% CI 2.00-2.00, 3 rounds)"


def test_the_interval_is_student_t_on_the_logs_of_the_ratios():
    # per-round ratios 1.1, 1.5, 1.0: hand computation
    logs = [math.log(1.1), math.log(1.5), math.log(1.0)]
    mean = sum(logs) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 2)
    half = T_975_DF2 * sd / math.sqrt(3)
    ratio = paired_ratio([11.0, 15.0, 10.0], [10.0, 10.0, 10.0])
    assert ratio.value == pytest.approx(math.exp(mean))
    assert ratio.low == pytest.approx(math.exp(mean - half)) and ratio.high == pytest.approx(math.exp(mean + half))
    # 0.70-2.00: the interval includes 1.0, so three rounds this spread do not decide
    assert (round(ratio.low, 3), round(ratio.high, 3)) == (0.698, 2.001)
    assert ratio.low < 1.0 < ratio.high
    assert ratio.verdict == "no measurable difference"
    assert ratio.reason.startswith("no measurable difference: 1.18x, 95% CI 0.70-2.00, 3 rounds includes 1.00")


def test_a_busy_round_is_left_out_and_too_few_quiet_rounds_are_unreliable():
    # round 2 ran while a neighbour held a core: its ratio (0.3) would drag a clear 2x down
    candidate, reference = [20.0, 6.0, 21.0, 19.0], [10.0, 20.0, 10.0, 10.0]
    kept = paired_ratio(candidate, reference, [True, False, True, True])
    assert kept.dropped == 1 and kept.rounds == 3 and kept.verdict == "faster"
    assert kept.value == pytest.approx((2.0 * 2.1 * 1.9) ** (1 / 3))
    few = paired_ratio(candidate, reference, [True, False, False, True], why_dropped="31% CPU steal")
    assert few.verdict == "unreliable" and few.value is None and few.low is None
    assert few.reason == ("unreliable: 2 of 4 rounds were quiet enough to compare (at least 3 needed); 31% CPU steal")
    assert relative_half_width(few) is None


def test_slower_and_the_noise_threshold():
    assert paired_ratio([5.0, 5.1, 4.9], [10.0, 10.0, 10.0]).verdict == "slower"
    three = paired_ratio([12.0, 15.0, 13.0], [10.0, 10.0, 10.0])  # 1.2, 1.5, 1.3: low 1.0026 just decides
    assert three.verdict == "faster" and round(three.low, 4) == 1.0026
    # 1.01x with a tight interval that excludes 1.0: within the 2% threshold, not a win
    tiny = paired_ratio([10.1, 10.1, 10.1, 10.1], [10.0, 10.0, 10.0, 10.0])
    assert tiny.low > 1.0 and tiny.verdict == "no measurable difference"
    assert "within the 2% noise threshold" in tiny.reason
    assert judge(1.03, 1.025, 1.035) == "faster"
    assert judge(1.03, 0.99, 1.07) == "no measurable difference"
    assert judge(0.5, 0.45, 0.55) == "slower"


def test_rounds_must_pair_up():
    with pytest.raises(ValueError, match="paired rounds differ in number: 2 candidate, 3 reference"):
        paired_ratio([1.0, 2.0], [1.0, 2.0, 3.0])


def test_welch_interval_for_two_runs_made_apart():
    a, b = [11.0, 12.0, 13.0], [10.0, 10.5, 9.5]
    la, lb = [math.log(x) for x in a], [math.log(x) for x in b]

    def var(xs: list[float]) -> float:
        m = sum(xs) / len(xs)
        return sum((x - m) ** 2 for x in xs) / (len(xs) - 1)

    va, vb = var(la) / 3, var(lb) / 3
    df = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 2)
    half = t_quantile(0.975, df) * math.sqrt(va + vb)
    mean = sum(la) / 3 - sum(lb) / 3
    ratio = unpaired_ratio(a, b)
    assert ratio.value == pytest.approx(math.exp(mean))
    assert ratio.low == pytest.approx(math.exp(mean - half)) and ratio.high == pytest.approx(math.exp(mean + half))
    assert ratio.verdict == "faster"
    assert unpaired_ratio([10.0], [10.0, 11.0]).verdict == "unreliable"
    same = unpaired_ratio([10.0, 10.0], [10.0, 10.0])
    assert same.value == 1.0 and same.verdict == "no measurable difference"


def test_a_plan_whose_own_quiet_rounds_straddle_the_reference_is_not_called_faster():
    # measured here: int8 weight-only decoding ran ~30 tok/s in the paired rounds and ~15 in an
    # unpaired quiet one, against a baseline at ~21: the pairs alone say 1.38x
    paired = paired_ratio([30.3, 28.4, 28.5, 30.2], [21.8, 19.9, 21.7, 22.0])
    assert paired.verdict == "faster"
    checked = check_overlap(paired, [30.3, 14.9, 28.4, 28.5, 30.2], [21.8, 19.9, 21.7, 22.0, 20.7])
    assert checked.verdict == "no measurable difference" and checked.value == paired.value
    assert checked.reason.startswith(
        "no measurable difference: its own quiet rounds ran from 0.69x to 1.40x the "
        "reference's median, on both sides of it"
    )
    assert checked.reason.endswith(paired.reason)
    # every round on one side: the verdict stands, whatever the spread
    assert check_overlap(paired, [30.3, 24.0, 28.4], [21.8, 19.9, 21.7]) is paired
    slower = paired_ratio([10.0, 10.5, 9.5], [20.0, 20.0, 20.0])
    assert check_overlap(slower, [10.0, 19.0, 9.5], [20.0, 20.0]) is slower
    assert check_overlap(slower, [10.0, 21.0, 9.5], [20.0, 20.0]).verdict == "no measurable difference"
    unsure = paired_ratio([1.0, 2.0, 1.0], [1.5, 1.5, 1.5])
    assert check_overlap(unsure, [1.0, 2.0], [1.5]) is unsure  # undecided stays as it is
