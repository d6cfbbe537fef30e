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


def test_the_cpu_each_test_used_is_summed_per_file_from_its_junit_property(tmp_path):
    path = tmp_path / "suite.xml"
    path.write_text(
        JUNIT.replace(
            'name="test_slow" time="200.0"/>',
            'name="test_slow" time="200.0"><properties><property name="cpu_s" value="350.5"/></properties></testcase>',
        ).replace(
            'name="test_fast" time="3.0"/>',
            'name="test_fast" time="3.0"><properties><property name="cpu_s" value="1.5"/></properties></testcase>',
        )
    )
    tests = suite_times.read_junit(path)
    assert [t.cpu_s for t in tests] == [1.5, None, 350.5]  # test_slowish has none: counted as 0
    text = suite_times.tables(tests, [], 5)
    assert "5.9 CPU-minutes in all" in text
    assert text.index("| 350 | `tests/test_b.py` |") < text.index("| 2 | `tests/test_a.py` |")
