"""tools/suite_times.py: the slowest tests, and which are over the budget of the CPU kind the run
was on (an AVX2-only CPU gives each test more time, the suite the same bound)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import suite_times  # noqa: E402 - tools/ is not a package: it is put on sys.path first

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="3" time="1500.0">
<testcase classname="tests.test_a" name="test_fast" time="3.0"/>
<testcase classname="tests.test_a" name="test_slowish" time="130.0"/>
<testcase classname="tests.test_b" name="test_slow" time="200.0"/>
</testsuite></testsuites>
"""


def test_the_tests_over_the_budget_of_the_runs_cpu_kind(tmp_path):
    path = tmp_path / "suite.xml"
    path.write_text(JUNIT)
    tests = suite_times.read_junit(path)
    assert [t.name for t in suite_times.over_budget(tests, "avx2")] == ["test_slow"]  # 150 s there
    assert [t.name for t in suite_times.over_budget(tests, "amx")] == ["test_slow", "test_slowish"]  # 120 s
    assert suite_times.read_wall_minutes(path) == 25.0
    text = suite_times.tables(tests, [], 2, "avx2", 25.0)
    assert "| avx2 (this run) | 150 s | 30 min |" in text
    assert "1 tests over 150 s on avx2:\n- 200.0 s `tests/test_b.py::test_slow`" in text
    assert "suite: 25.0 min on two workers, within its 30 min on avx2" in text
    assert "OVER its 28 min on amx" in suite_times.tables(tests, [], 2, "amx", 29.0)
