"""The tuner's search with a fake measure function: milliseconds, no models."""

from accelab.tuner.search import Candidate, Constraints, Measurement, Search

# A fake machine: throughput per variant grows with batch and saturates; memory grows with batch.
SPEED = {"baseline": 10.0, "fast": 14.0, "faster": 18.0, "broken": 30.0}


def fake_measure(calls, *, oom_at=None, latency_per_item=10.0, quality=None):
    def measure(c: Candidate, phase):
        calls.append((c.key, phase))
        if c.variant == "unsupported":
            return Measurement(candidate=c, phase=phase, status="unsupported", reason="no GPU", seconds=0.1)
        if oom_at is not None and c.batch_size >= oom_at:
            return Measurement(candidate=c, phase=phase, status="oom", reason="OutOfMemoryError (fake)", seconds=1)
        sat = c.batch_size / (c.batch_size + 8)  # saturating throughput curve
        tp = SPEED[c.variant] * 10 * sat
        return Measurement(
            candidate=c,
            phase=phase,
            status="ok",
            throughput=tp,
            p50_ms=c.batch_size * 1000 / tp,
            p99_ms=c.batch_size * 1000 / tp * 1.2,
            memory_mb=400 + 50 * c.batch_size,
            quality=(quality or {}).get(c.variant, "pass"),
            cv=0.01,
            seconds=2.0 if phase in ("screen", "grow") else 5.0,
        )

    return measure


LADDER = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def test_finds_fastest_variant_and_grows_batch():
    calls = []
    log = Search(
        variants=["baseline", "fast", "faster"],
        batch_sizes=LADDER,
        measure=fake_measure(calls),
        constraints=Constraints(quality="off"),
        screen_batch=8,
    ).run()
    assert log.winner.candidate.variant == "faster"
    assert log.winner.candidate.batch_size >= 64  # grew until gains fell under 3%
    assert log.verdicts["baseline@8"].startswith("slower")
    # cheaper than the exhaustive grid of 3 x 9 full runs
    assert len(calls) < 3 * len(LADDER)


def test_memory_limit_excludes_large_batches_and_bisects():
    calls = []
    limit = 400 + 50 * 40  # batch 40 fits, 41 does not
    log = Search(
        variants=["baseline", "faster"],
        batch_sizes=LADDER,
        measure=fake_measure(calls),
        constraints=Constraints(max_memory_mb=limit, quality="off"),
        screen_batch=8,
    ).run()
    assert log.winner.memory_mb <= limit
    assert 32 <= log.winner.candidate.batch_size <= 40  # bisected between 32 (fits) and 64 (too big)
    assert any("memory" in v for v in log.verdicts.values())


def test_p99_sla_excludes_big_batches():
    log = Search(
        variants=["baseline", "faster"],
        batch_sizes=LADDER,
        measure=fake_measure([]),
        constraints=Constraints(p99_ms=60, quality="off"),
        screen_batch=8,
    ).run()
    assert log.winner.p99_ms <= 60
    assert any(v.startswith("p99") for v in log.verdicts.values())


def test_oom_stops_growth_without_crashing():
    log = Search(
        variants=["faster"],
        batch_sizes=LADDER,
        measure=fake_measure([], oom_at=100),
        constraints=Constraints(quality="off"),
        screen_batch=8,
        min_gain=0.0,
    ).run()
    assert log.winner.candidate.batch_size < 100
    assert any(v == "out of memory" for v in log.verdicts.values())


def test_quality_failure_removes_fastest_plan():
    log = Search(
        variants=["baseline", "fast", "broken"],
        batch_sizes=LADDER,
        measure=fake_measure([], quality={"broken": "fail"}),
        constraints=Constraints(quality="balanced"),
        screen_batch=8,
    ).run()
    assert log.winner.candidate.variant == "fast"
    assert log.verdicts["broken@8"] == "quality failed"


def test_unsupported_is_reported_not_measured_twice():
    calls = []
    log = Search(
        variants=["baseline", "unsupported"],
        batch_sizes=LADDER,
        measure=fake_measure(calls),
        constraints=Constraints(quality="off"),
        screen_batch=8,
    ).run()
    assert [c for c in calls if c[0].startswith("unsupported")] == [("unsupported@8", "screen")]
    assert log.verdicts["unsupported@8"] == "unsupported here: no GPU"


def test_impossible_limit_says_which_limit():
    log = Search(
        variants=["baseline", "fast"],
        batch_sizes=LADDER,
        measure=fake_measure([]),
        constraints=Constraints(max_memory_mb=100, quality="off"),
        screen_batch=8,
    ).run()
    assert log.winner is None
    assert "memory limit (100 MB)" in log.no_feasible_reason


def test_tie_within_noise():
    def measure(c, phase):
        tp = {"a": 100.0, "b": 101.0}[c.variant]
        return Measurement(
            candidate=c,
            phase=phase,
            status="ok",
            throughput=tp,
            p50_ms=10,
            p99_ms=12,
            memory_mb=500,
            cv=0.02,
            seconds=1,
        )

    log = Search(
        variants=["a", "b"], batch_sizes=[1], measure=measure, constraints=Constraints(quality="off"), screen_batch=1
    ).run()
    assert log.tie is True
    assert "tie" in log.verdicts[log.runner_up.candidate.key]


def test_latency_goal_prefers_lowest_latency():
    log = Search(
        variants=["baseline", "fast", "faster"],
        batch_sizes=[1],
        measure=fake_measure([]),
        constraints=Constraints(quality="off"),
        goal="latency-p99",
        screen_batch=1,
    ).run()
    assert log.winner.candidate.key == "faster@1"


def test_budget_stops_search_with_best_so_far(clock):
    def measure(c, phase):
        clock.advance(10)
        return fake_measure([])(c, phase)

    log = Search(
        variants=["baseline", "fast", "faster"],
        batch_sizes=LADDER,
        measure=measure,
        constraints=Constraints(quality="off"),
        screen_batch=8,
        budget_s=25,
        clock=clock,
    ).run()
    assert log.budget_spent
    assert log.winner is not None and len(log.measurements) == 3


def _scripted(values):
    """A measure that returns the throughputs in `values[(key, phase)]`, in order when a list."""
    calls = []

    def measure(c, phase):
        calls.append((c.key, phase))
        value = values[(c.variant, phase)]
        tp = value.pop(0) if isinstance(value, list) else value
        return Measurement(
            candidate=c,
            phase=phase,
            status="ok",
            throughput=tp,
            p50_ms=10,
            p99_ms=12,
            memory_mb=500,
            cv=0.005,
            seconds=1,
        )

    return measure, calls


def test_a_lead_beyond_noise_in_the_final_decides():
    measure, calls = _scripted(
        {("a", "screen"): 100.0, ("b", "screen"): 90.0, ("a", "final"): 104.0, ("b", "final"): 92.0}
    )
    log = Search(
        variants=["a", "b"], batch_sizes=[1], measure=measure, constraints=Constraints(quality="off"), screen_batch=1
    ).run()
    assert log.winner.candidate.variant == "a" and not log.tie
    assert log.verdicts == {"a@1": "winner", "b@1": "runner-up"}
    assert [phase for _, phase in calls] == ["screen", "screen", "final", "final"]


def test_a_final_within_noise_is_a_tie():
    # 2% apart in the full-length runs: under the 3% noise floor
    measure, calls = _scripted(
        {("a", "screen"): 100.0, ("b", "screen"): 90.0, ("a", "final"): 102.0, ("b", "final"): 104.0}
    )
    log = Search(
        variants=["a", "b"], batch_sizes=[1], measure=measure, constraints=Constraints(quality="off"), screen_batch=1
    ).run()
    assert log.tie and log.winner.candidate.variant == "b"  # the faster of the two is written
    assert log.verdicts["a@1"] == "tie with the winner (within noise)"
    assert [phase for _, phase in calls] == ["screen", "screen", "final", "final"]  # no further runs


def test_noisy_finals_widen_what_counts_as_a_tie():
    # 5% apart, but each final's mean is uncertain by 4% (cv): within 2 x 4%, a tie
    calls = []

    def measure(c, phase):
        calls.append((c.key, phase))
        tp = {"a": 100.0, "b": 95.0}[c.variant] if phase == "final" else 50.0
        return Measurement(
            candidate=c,
            phase=phase,
            status="ok",
            throughput=tp,
            p50_ms=10,
            p99_ms=12,
            memory_mb=500,
            cv=0.04 if phase == "final" else 0.005,
            seconds=1,
        )

    log = Search(
        variants=["a", "b"], batch_sizes=[1], measure=measure, constraints=Constraints(quality="off"), screen_batch=1
    ).run()
    assert log.winner.candidate.variant == "a" and log.tie


def test_the_full_length_runs_overrule_the_screening_order():
    # b led the short screening run; the full-length final puts a ahead by 13%, far beyond the noise
    measure, calls = _scripted(
        {("a", "screen"): 100.0, ("b", "screen"): 103.0, ("a", "final"): 104.0, ("b", "final"): 92.0}
    )
    log = Search(
        variants=["a", "b"], batch_sizes=[1], measure=measure, constraints=Constraints(quality="off"), screen_batch=1
    ).run()
    assert log.winner.candidate.variant == "a" and log.runner_up.candidate.variant == "b"
    assert not log.tie
    assert [phase for _, phase in calls] == ["screen", "screen", "final", "final"]


def test_a_bigger_batch_faster_within_noise_reaches_the_final():
    # batch 16 is 1.8% faster than 8 at screening length (under min_gain): growth stops, but
    # both go to the full-length runs, which show 16 ahead by 5%, beyond their noise: decided
    speed = {
        ("c", 8, "screen"): 79.8,
        ("c", 16, "grow"): 81.2,
        ("c", 8, "final"): 77.4,
        ("c", 16, "final"): 81.6,
        ("b", 8, "screen"): 66.0,
        ("b", 16, "grow"): 69.5,
        ("b", 32, "grow"): 71.0,
    }
    calls = []

    def measure(c, phase):
        calls.append((c.key, phase))
        tp = speed[(c.variant, c.batch_size, phase)]
        return Measurement(
            candidate=c,
            phase=phase,
            status="ok",
            throughput=tp,
            p50_ms=10,
            p99_ms=12,
            memory_mb=500,
            cv=0.005,
            seconds=1,
        )

    log = Search(
        variants=["b", "c"],
        batch_sizes=[8, 16, 32],
        measure=measure,
        constraints=Constraints(quality="off"),
        screen_batch=8,
    ).run()
    assert [key for key, phase in calls if phase == "final"] == ["c@16", "c@8"]
    assert not log.tie
    assert log.winner.candidate.key == "c@16" and log.runner_up.candidate.key == "c@8"
    assert log.verdicts["b@32"].startswith("slower")


# -- the final side by side: paired rounds decide (the statistics of compare and regress) -----------
def side_by_side(rounds: dict[str, list[float]], usable: dict[str, list[bool]] | None = None, calls=None):
    """A fake measure_together: each finalist's per-round rates as given; its pooled throughput
    is their mean."""

    def together(candidates, phase):
        if calls is not None:
            calls.append(([c.key for c in candidates], phase))
        out = []
        for c in candidates:
            rates = rounds[c.variant]
            out.append(
                Measurement(
                    candidate=c,
                    phase=phase,
                    status="ok",
                    throughput=sum(rates) / len(rates),
                    p50_ms=10.0,
                    p99_ms=12.0,
                    memory_mb=500.0,
                    quality="pass",
                    cv=0.01,
                    seconds=6.0,
                    rates=tuple(rates),
                    usable=tuple((usable or {}).get(c.variant, [True] * len(rates))),
                )
            )
        return out

    return together


def search_with(together) -> Search:
    return Search(
        variants=["baseline", "fast"],
        batch_sizes=[1],
        measure=fake_measure([]),
        measure_together=together,
        constraints=Constraints(quality="off"),
        goal="latency-p50",
    )


def test_the_final_runs_both_finalists_together_and_a_clear_paired_lead_decides():
    calls = []
    log = search_with(
        side_by_side({"fast": [14.0, 14.2, 13.9, 14.1], "baseline": [10.0, 10.1, 9.9, 10.0]}, calls=calls)
    ).run()
    assert calls == [(["fast@1", "baseline@1"], "final")]
    assert log.winner.candidate.key == "fast@1" and not log.tie
    assert log.final_ratio.startswith("fast@1 over baseline@1: 1.40x (faster; 95% CI 1.40-1.41, 4 rounds)")
    assert log.verdicts["baseline@1"] == "runner-up (1.40x (faster; 95% CI 1.40-1.41, 4 rounds))"


def test_an_interval_that_includes_one_is_a_tie_that_says_so():
    log = search_with(side_by_side({"fast": [10.5, 9.6, 10.4, 9.7], "baseline": [10.0, 10.1, 9.9, 10.0]})).run()
    assert log.tie
    assert log.verdicts[log.runner_up.candidate.key].startswith("tie with the winner (no measurable difference:")


def test_too_few_quiet_rounds_is_a_tie_and_the_rounds_order_wins_over_pooled_figures():
    # the pooled means say fast (a busy round inflated it), the quiet rounds say baseline
    rates = {"fast": [30.0, 9.0, 9.1, 8.9], "baseline": [10.0, 10.1, 10.0, 9.9]}
    log = search_with(side_by_side(rates, usable={"fast": [False, True, True, True]})).run()
    assert log.winner.candidate.key == "baseline@1" and not log.tie
    assert log.final_ratio.startswith("baseline@1 over fast@1: 1.11x (faster")
    noisy = search_with(side_by_side(rates, usable={"fast": [False, False, True, True]})).run()
    assert noisy.tie and "unreliable: 2 of 4 rounds were quiet enough" in noisy.final_ratio
