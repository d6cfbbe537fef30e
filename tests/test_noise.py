"""The machine's noise around a timed window (accelab.measure.noise): parsing /proc/stat and
cgroup cpu.stat, the window's figures from two snapshots, and the documented thresholds. Fake
readings, exact asserts; one test reads the real machine with a real busy process beside it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from accelab.measure import noise
from accelab.measure.noise import CpuTicks, Snapshot, Window, classify, parse_proc_stat, parse_throttled_seconds

PROC_STAT = """cpu  50316 0 9139 16981 153 0 92 176 0 0
cpu0 23804 0 4101 10378 25 0 10 84 0 0
cpu1 26511 0 5037 6602 128 0 81 92 0 0
intr 123 4 5
"""


def test_the_aggregate_cpu_line_is_parsed_in_its_documented_order():
    ticks = parse_proc_stat(PROC_STAT)
    assert ticks == CpuTicks(user=50316, nice=0, system=9139, idle=16981, iowait=153, irq=0, softirq=92, steal=176)
    assert ticks.busy == 50316 + 9139 + 92
    assert ticks.total == 50316 + 9139 + 92 + 16981 + 153 + 176
    with pytest.raises(ValueError, match="no aggregate 'cpu' line"):
        parse_proc_stat("cpu0 1 2 3 4 5 6 7 8\n")


def test_throttled_time_from_cgroup_v2_and_v1():
    assert parse_throttled_seconds("usage_usec 100\nnr_throttled 3\nthrottled_usec 2500000\n") == 2.5
    assert parse_throttled_seconds("nr_periods 0\nnr_throttled 0\nthrottled_time 1500000000\n") == 1.5
    assert parse_throttled_seconds("usage_usec 100\n") == 0.0


def ticks(*, busy: int, idle: int, steal: int = 0) -> CpuTicks:
    return CpuTicks(user=busy, nice=0, system=0, idle=idle, iowait=0, irq=0, softirq=0, steal=steal)


def snap(wall: float, t: CpuTicks, own: float = 0.0, throttled: float = 0.0, load: float = 0.5) -> Snapshot:
    return Snapshot(wall=wall, ticks=t, own_cpu_s=own, throttled_s=throttled, load1=load)


def test_a_window_separates_our_cpu_from_the_rest_of_the_machine():
    # 2 s on a 2-core machine at 100 ticks/s = 400 ticks: 360 busy (3.6 s), 20 idle, 20 stolen.
    # The measuring processes used 2.0 CPU seconds, so the others used 1.6 s; less one tick per
    # core of counter rounding (0.02 s), 1.58 s = 0.79 cores; steal 20 ticks less 2 of 400.
    w = noise.window(
        snap(10.0, ticks(busy=1000, idle=500, steal=10), own=5.0),
        snap(12.0, ticks(busy=1360, idle=520, steal=30), own=7.0, throttled=0.0, load=2.5),
        hz=100,
        cores=2,
    )
    assert w.seconds == 2.0
    assert w.steal == pytest.approx(18 / 400)
    assert w.others_cores == pytest.approx(0.79)
    assert w.throttled == 0.0 and w.load1 == 2.5
    assert classify(w) == ("unreliable", "other processes used 0.79 cores")


def test_a_stray_tick_in_a_short_window_is_not_noise():
    # 20 ms: one tick of someone else's CPU and one of steal would read as 0.5 cores and 25% steal
    w = noise.window(
        snap(0.0, ticks(busy=0, idle=0, steal=0), own=0.0),
        snap(0.02, ticks(busy=1, idle=2, steal=1), own=0.0),
        hz=100,
        cores=2,
    )
    assert w.others_cores == 0.0 and w.steal == 0.0 and w.level == "quiet"


def test_our_own_cpu_is_never_counted_as_someone_elses():
    # the measurement took 3.7 CPU s in 2 s, a tick more than the machine counted (tick rounding)
    w = noise.window(
        snap(0.0, ticks(busy=0, idle=0), own=0.0), snap(2.0, ticks(busy=360, idle=40), own=3.7), hz=100, cores=2
    )
    assert w.others_cores == 0.0 and w.level == "quiet"


def window(**kw) -> Window:
    return Window(**{"seconds": 1.0, "steal": 0.0, "others_cores": 0.0, "throttled": 0.0, "load1": 0.0, **kw})


@pytest.mark.parametrize(
    ("figures", "expected"),
    [
        ({}, ("quiet", "")),
        ({"steal": 0.029}, ("quiet", "")),
        ({"steal": 0.03}, ("noisy", "3% CPU steal")),
        ({"steal": 0.10}, ("unreliable", "10% CPU steal")),
        ({"others_cores": 0.099}, ("quiet", "")),
        ({"others_cores": 0.10}, ("noisy", "other processes used 0.10 cores")),
        ({"others_cores": 0.30}, ("unreliable", "other processes used 0.30 cores")),
        ({"throttled": 0.02}, ("noisy", "the cgroup throttled the CPU 2% of the time")),
        ({"throttled": 0.10}, ("unreliable", "the cgroup throttled the CPU 10% of the time")),
        ({"cv": 0.099}, ("quiet", "")),
        ({"cv": 0.10}, ("noisy", "calls spread 10% (cv)")),
        ({"cv": 5.0}, ("noisy", "calls spread 500% (cv)")),  # spread alone never makes a row unreliable
        ({"steal": 0.31, "others_cores": 0.5}, ("unreliable", "31% CPU steal, other processes used 0.50 cores")),
        ({"steal": 0.05, "cv": 0.2}, ("noisy", "5% CPU steal, calls spread 20% (cv)")),
    ],
)
def test_the_documented_thresholds(figures, expected):
    assert classify(window(**figures)) == expected


def test_the_summary_is_as_loud_as_the_loudest_round_it_kept():
    rounds = [window(), window(steal=0.05), window(others_cores=0.9), window()]
    record = noise.summary(rounds, [True, True, False, True])
    assert record["level"] == "noisy" and record["rounds"] == 4 and record["rounds_used"] == 3
    assert record["reason"] == "other processes used 0.90 cores"  # the worst window, kept or not
    assert record["steal_max"] == 0.05 and record["others_cores_max"] == 0.9
    assert record["others_cores"] == pytest.approx(0.9 / 4)
    none_kept = noise.summary(rounds, [False] * 4)
    assert none_kept["level"] == "unreliable" and none_kept["rounds_used"] == 0
    assert noise.summary([]) == {}


def test_a_real_busy_process_shows_as_other_processes_and_sleeping_as_quiet():
    """Real /proc/stat: a busy loop in another process takes about one core of the window."""
    idle = noise.sample_now(0.5)  # how loud the shared machine is now is not ours to assert
    assert idle is not None and idle.seconds == pytest.approx(0.5, abs=0.1) and 0.0 <= idle.others_cores <= 2.0
    # started through a shell that exits at once, so the loop is not this process's descendant
    # (descendants count as the measurement's own: compile workers, dataloader workers)
    pid = int(
        subprocess.check_output(["sh", "-c", f"'{sys.executable}' -c 'while True: pass' >/dev/null 2>&1 & echo $!"])
    )
    try:
        time.sleep(0.3)
        with noise.Meter() as meter:
            time.sleep(1.0)
        busy = meter.window
        before = noise.snapshot([pid])  # the same loop counted as the measurement's own
        time.sleep(1.0)
        after = noise.snapshot([pid])
    finally:
        os.kill(pid, signal.SIGKILL)
    # on 2 cores the loop gets at least half a core even beside two other busy processes
    assert busy is not None and busy.others_cores >= 0.5
    assert busy.level == "unreliable" and "other processes used" in busy.reason
    assert before is not None and after is not None and after.own_cpu_s - before.own_cpu_s >= 0.4


def test_settle_waits_for_a_plans_threads_to_idle_and_gives_up_on_one_that_never_does():
    """A real process busy for 0.6 s then asleep (a plan's engine after its turn): settled soon after
    it sleeps; one that spins on is waited for only up to the timeout."""
    spin_then_sleep = "import time\nend = time.monotonic() + 0.6\nwhile time.monotonic() < end: pass\ntime.sleep(60)"
    calm = subprocess.Popen([sys.executable, "-c", spin_then_sleep])
    spinning = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.1)
        waited = noise.settle([calm.pid], timeout_s=10)
        assert 0.2 <= waited < 5  # past the spin (its start included), not the timeout
        assert noise.settle([spinning.pid], timeout_s=1.0) == pytest.approx(1.0, abs=0.3)
        assert noise.settle([calm.pid]) < 0.5  # idle already: one look
    finally:
        calm.kill()
        spinning.kill()
