"""When the rounds of a bench or compare stop: enough quiet rounds, and enough calls in them for
--min-iters (noisy rounds are dropped, so a run that measured 3 calls may keep only 2)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from accelab.benchmark.child import RoundDone
from accelab.benchmark.contenders import Contender, RoundsConfig, needs_more
from accelab.measure import noise
from accelab.measure.noise import Window
from accelab.plan.plan import Plan
from accelab.scenarios.workload import Workload

QUIET = Window(seconds=1.0, steal=0.0, others_cores=0.0, throttled=0.0, load1=0.1)
LOUD = Window(seconds=1.0, steal=0.4, others_cores=0.0, throttled=0.0, load1=2.0)


def contender(min_iters: int, rounds: list[tuple[int, Window]]) -> Contender:
    c = Contender(plan=Plan(), workload=Workload(min_iters=min_iters), job=cast(Any, None))
    c.loaded = cast(Any, SimpleNamespace(status="ok", worker_pids=()))
    for calls, window in rounds:
        c.rounds.append(RoundDone(seconds=0.2, calls=calls, rate=10.0, cv=0.01))
        c.windows.append(window)
    return c


def test_a_bench_goes_on_while_its_quiet_rounds_hold_fewer_calls_than_min_iters():
    config = RoundsConfig.single()
    # two quiet rounds of one call each (slow calls), a third dropped as noisy: 2 calls kept of 3 asked
    short = contender(3, [(1, QUIET), (1, LOUD), (1, QUIET)])
    assert short.quiet_rounds == (0, 2) and short.short_of_calls
    assert needs_more([short], config)
    enough = contender(3, [(1, QUIET), (1, LOUD), (1, QUIET), (1, QUIET)])
    assert not enough.short_of_calls and not needs_more([enough], config)


def test_a_compare_goes_on_while_one_plan_is_short_of_calls():
    config = RoundsConfig()  # 3 quiet pairs needed
    reference = contender(4, [(2, QUIET)] * 3)
    other = contender(4, [(1, QUIET)] * 3)  # 3 quiet pairs, but its slow calls make 3 of the 4 asked
    assert needs_more([reference, other], config)
    for c in (reference, other):
        c.rounds.append(RoundDone(seconds=0.2, calls=1, rate=10.0, cv=0.01))
        c.windows.append(QUIET)
    assert not needs_more([reference, other], config)


def test_min_iters_is_a_floor_when_the_extra_rounds_run_out_on_a_loud_machine():
    # six rounds of one call, five of them loud: the quiet one holds 1 call of the 3 asked, so the
    # least loud of the dropped rounds are kept until 3 calls, and the row's noise says unreliable
    louder = Window(seconds=1.0, steal=0.8, others_cores=0.0, throttled=0.0, load1=2.0)
    c = contender(3, [(1, louder), (1, LOUD), (1, QUIET), (1, louder), (1, LOUD), (1, louder)])
    assert c.short_of_calls and c.quiet_rounds == (2,)
    assert c.kept == (1, 2, 4) and sum(c.rounds[i].calls for i in c.kept) == 3
    assert [c.usable(i) for i in range(6)] == [False, True, True, False, True, False]
    assert noise.summary(c.windows, [c.usable(i) for i in range(6)])["level"] == "unreliable"
    # with enough quiet calls nothing loud is kept
    quiet = contender(2, [(1, LOUD), (1, QUIET), (1, QUIET)])
    assert quiet.kept == (1, 2) and not quiet.short_of_calls
