"""Fixtures shared by the tests. Helpers that tests import by name live beside this file
(fake_clock.py, fakes_serve.py, serving.py): pytest puts tests/ on sys.path."""

from __future__ import annotations

import pytest
from fake_clock import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    """A fresh fake clock at 100 s; `clock.advance(s)` moves it."""
    return FakeClock()
