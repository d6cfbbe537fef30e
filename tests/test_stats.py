"""Statistics and the timed loop, with a fake clock."""

import math

import pytest

from accelab.measure.stats import percentile, summarize, timed_loop


def test_summarize_numbers():
    s = summarize([1.0, 2.0, 3.0, 4.0, 10.0])
    assert s.n == 5
    assert s.mean == pytest.approx(4.0)
    assert s.p50 == pytest.approx(3.0)
    assert s.min == 1.0 and s.max == 10.0
    assert s.p90 == pytest.approx(4 + 0.6 * 6)  # rank 3.6 between 4 and 10
    assert s.stdev == pytest.approx(math.sqrt(sum((x - 4) ** 2 for x in [1, 2, 3, 4, 10]) / 4))
    assert s.cv == pytest.approx(s.stdev / 4)


def test_percentile_matches_numpy():
    np = pytest.importorskip("numpy")
    values = sorted([0.3, 7.1, 2.2, 9.9, 4.4, 5.0, 1.1])
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_summarize_single_and_empty():
    assert summarize([5.0]).stdev == 0.0
    with pytest.raises(ValueError, match="empty"):
        summarize([])


def test_timed_loop_needs_min_iters_and_min_seconds(clock):
    calls = []

    def call():
        calls.append(clock.now)
        clock.advance(0.5)  # every call takes 0.5 s of fake time

    timing = timed_loop(call, warmup=2, min_iters=3, min_seconds=4.0, clock=clock)
    # 3 iterations give 1.5 s < 4 s: the loop keeps going until 8 calls (4.0 s)
    assert timing.iterations == 8
    assert timing.durations == [0.5] * 8
    assert timing.wall_seconds == pytest.approx(4.0)
    assert timing.warmup_seconds == [0.5, 0.5]
    assert len(calls) == 10


def test_timed_loop_min_iters_dominates_when_calls_are_slow(clock):

    def call():
        clock.advance(10.0)

    timing = timed_loop(call, warmup=0, min_iters=4, min_seconds=1.0, clock=clock)
    assert timing.iterations == 4


def test_timed_loop_max_seconds_stops_a_slow_model(clock):

    def call():
        clock.advance(30.0)

    timing = timed_loop(call, warmup=1, min_iters=100, min_seconds=1.0, max_seconds=60.0, clock=clock)
    assert timing.iterations == 2


def test_capped_samples_keeps_shape():
    from accelab.measure.stats import capped_samples

    values = [float(v) for v in range(10_000, 0, -1)]
    capped = capped_samples(values, cap=101)
    assert len(capped) == 101 and capped[0] == 1.0 and capped[-1] == 10_000.0
    assert capped == sorted(capped)
    assert capped_samples([3.0, 1.0]) == [1.0, 3.0]
