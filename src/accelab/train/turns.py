"""`train --bench` rows taking turns: every row trains at once, but only one row's optimizer
steps run at a time, in alternating rounds (A B C, C B A, ...), so a busy minute slows every
row alike (the idea of `accelab.benchmark.rounds`, for runs that are whole torchrun launches).

The protocol is a directory of small files, because a row can be several processes (torchrun
ranks) that the parent did not spawn itself:

- the parent writes `turn`: "<row> <round>" gives row its turn in that round, "stop <row>" stops it;
- a row's rank 0 writes `<row>.ready` after its warm-up steps, `<row>.<round>.json` with the
  durations of the steps it ran in that turn (about `seconds_per_turn` of them), and
  `<row>.finished` after its last step.

Workers poll `turn` every POLL_S while they wait (asleep, never spinning); the wait is paused out
of the step timer. Files are written atomically (a temporary name, then rename).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

POLL_S = 0.02
TURN = "turn"


class Stopped(RuntimeError):
    """The parent stopped this row (past its time budget)."""


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


class Gate:
    """The worker's side: call `after_step(step, seconds)` after every optimizer step; it blocks
    while it is another row's turn. A turn lasts `seconds_per_turn` of step time (at least one
    step). `timed_from`: steps done before turns begin (the warm-up); `last_step`: the run's last."""

    def __init__(
        self,
        directory: str | Path,
        row: str,
        *,
        main: bool,
        seconds_per_turn: float,
        timed_from: int,
        last_step: int,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.dir, self.row, self.main = Path(directory), row, main
        self.seconds_per_turn, self.timed_from, self.last_step, self.sleep = (
            seconds_per_turn,
            timed_from,
            last_step,
            sleep,
        )
        self.round: int | None = None  # the round this row is running, None while it waits
        self.served = -1  # the last round it ran
        self.durations: list[float] = []

    def after_step(self, step: int, seconds: float) -> bool:
        """`step`: optimizer steps done. True when it waited (the caller's timer restarts)."""
        if step < self.timed_from:
            return False
        if self.round is not None:
            self.durations.append(seconds)
            if sum(self.durations) < self.seconds_per_turn and step < self.last_step:
                return False
            self._report()
            if step >= self.last_step:  # the last step: nothing more to wait for (finish() follows)
                return False
        elif step >= self.last_step:
            return False
        elif self.main:
            _write(self.dir / f"{self.row}.ready", "")
        self.wait()
        return True

    def wait(self) -> None:
        """Until the parent gives this row a round it has not run yet (or stops it)."""
        while True:
            text = (_read(self.dir / TURN) or "").split()
            if text == ["stop", self.row]:
                raise Stopped(f"row {self.row} was stopped by the parent")
            if len(text) == 2 and text[0] == self.row and int(text[1]) > self.served:
                self.round = self.served = int(text[1])
                return
            self.sleep(POLL_S)

    def _report(self) -> None:
        if self.main and self.round is not None:
            _write(self.dir / f"{self.row}.{self.round}.json", json.dumps(self.durations))
        self.durations, self.round = [], None

    def finish(self) -> None:
        """After the last step: the partial turn's steps, then `finished`."""
        if self.round is not None and self.durations:
            self._report()
        if self.main:
            _write(self.dir / f"{self.row}.finished", "")


class Table:
    """The parent's side of the directory."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        _write(self.dir / TURN, "")

    def ready(self, row: str) -> bool:
        return (self.dir / f"{row}.ready").exists()

    def finished(self, row: str) -> bool:
        return (self.dir / f"{row}.finished").exists()

    def give(self, row: str, round_index: int) -> None:
        _write(self.dir / TURN, f"{row} {round_index}")

    def stop(self, row: str) -> None:
        _write(self.dir / TURN, f"stop {row}")

    def report(self, row: str, round_index: int) -> list[float] | None:
        text = _read(self.dir / f"{row}.{round_index}.json")
        return json.loads(text) if text else None

    def wait_for(
        self,
        done: Callable[[], bool],
        *,
        timeout_s: float,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> bool:
        """Poll `done` until it is true (True) or `timeout_s` passes (False)."""
        end = clock() + timeout_s
        while not done():
            if clock() >= end:
                return False
            sleep(POLL_S)
        return True
