"""The turn protocol of train --bench rows (accelab.train.turns): two real threads play two rows'
workers against the parent's Table in a temporary directory; a fake sleep only yields."""

from __future__ import annotations

import threading
import time

import pytest

from accelab.train import turns


def worker(directory, row, log, *, steps, step_s, timed_from=1, seconds_per_turn=0.05):
    gate = turns.Gate(
        directory,
        row,
        main=True,
        seconds_per_turn=seconds_per_turn,
        timed_from=timed_from,
        last_step=steps,
        sleep=lambda s: time.sleep(0.001),
    )
    try:
        for step in range(1, steps + 1):
            log.append((row, step))
            gate.after_step(step, step_s)
        gate.finish()
    except turns.Stopped:
        log.append((row, "stopped"))


def test_rows_run_only_in_their_turns_in_alternating_order(tmp_path):
    table = turns.Table(tmp_path)
    log: list = []
    threads = [
        threading.Thread(target=worker, args=(tmp_path, row, log), kwargs={"steps": 6, "step_s": 0.03})
        for row in ("a", "b")
    ]
    for t in threads:
        t.start()
    for row in ("a", "b"):  # the warm-up step ran at once, then each waits at the gate
        assert table.wait_for(lambda row=row: table.ready(row), timeout_s=10, sleep=lambda s: time.sleep(0.001))
    assert sorted(log) == [("a", 1), ("b", 1)]
    reports = {}
    for index, row in enumerate(["a", "b", "b", "a"]):  # A B, B A
        round_index = index // 2
        before = len(log)
        table.give(row, round_index)
        assert table.wait_for(
            lambda row=row, round_index=round_index: table.report(row, round_index) is not None,
            timeout_s=10,
            sleep=lambda s: time.sleep(0.001),
        )
        reports[(row, round_index)] = table.report(row, round_index)
        # only the row whose turn it is ran: two steps of 0.03 s fill its 0.05 s turn
        assert {r for r, _ in log[before:]} <= {row} and len(log) - before == 2
    assert reports[("a", 0)] == [0.03, 0.03] and reports[("b", 1)] == [0.03, 0.03]
    table.give("a", 2)  # a's last step: a partial turn, then finished
    assert table.wait_for(lambda: table.finished("a"), timeout_s=10)
    table.give("b", 2)
    assert table.wait_for(lambda: table.finished("b"), timeout_s=10)
    for t in threads:
        t.join(5)
    assert table.report("a", 2) == [0.03] and table.report("b", 2) == [0.03]
    assert [s for r, s in log if r == "a"] == [1, 2, 3, 4, 5, 6]


def test_a_stopped_row_ends_and_says_why(tmp_path):
    table = turns.Table(tmp_path)
    log: list = []
    thread = threading.Thread(target=worker, args=(tmp_path, "slow", log), kwargs={"steps": 50, "step_s": 0.01})
    thread.start()
    assert table.wait_for(lambda: table.ready("slow"), timeout_s=10)
    table.stop("slow")
    thread.join(10)
    assert not thread.is_alive() and log[-1] == ("slow", "stopped") and not table.finished("slow")


def test_waiting_times_out_with_false(tmp_path):
    table = turns.Table(tmp_path)
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    assert table.wait_for(lambda: False, timeout_s=1.0, sleep=sleep, clock=lambda: now[0]) is False
    assert now[0] == pytest.approx(1.0, abs=turns.POLL_S)
