"""The one fake clock of the tests: time moves only when a test moves it."""

from __future__ import annotations


class FakeClock:
    """A `clock()` callable for code that takes one (batcher, scheduler, timers, searches).
    Starts at 100 s, not 0, so that code which mistakes a time for a duration shows it."""

    def __init__(self, start: float = 100.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
