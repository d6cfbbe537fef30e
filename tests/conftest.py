"""Fixtures shared by the tests. Helpers that tests import by name live beside this file
(fake_clock.py, fakes_serve.py, serving.py): pytest puts tests/ on sys.path."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import resource
import tempfile
from collections.abc import Iterator

import pytest
from fake_clock import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    """A fresh fake clock at 100 s; `clock.advance(s)` moves it."""
    return FakeClock()


# Under pytest-xdist (`make test` runs two workers, `--dist loadgroup`), the tests of one file run
# on one worker, so a module-scoped server or model is built once; a file marks a group of its own
# (`pytest.mark.xdist_group("vllm")`) when it shares something with other files.
#
# A test marked `alone` runs with no other test beside it (`_alone_or_shared`): the tests that
# measure speed, or whose timing a second worker's load would change. Every such test joins one
# group, ALONE, handed out first and run back to back under one hold of the run's lock: each time
# an alone test had to wait for the other worker's current test to end, a core idled (3-4 minutes
# of a 41-minute run on a 2-core AVX2 EPYC, with a dozen such turns). The other worker opens with
# OPENER, whose first tests take milliseconds, so the alone block starts at once; then the rest of
# the files go out slowest first (the order below, from `pytest --durations=0`), so no long file
# starts last while the other worker idles.
ALONE = "alone"
OPENER = "test_report"
SLOWEST_FIRST = (
    "test_tune_serve",
    "test_train_e2e",
    "test_custom_models",
    "test_openvino_genai_e2e",
    "test_bench_e2e",
    "test_openai_fields",
    "test_quality_e2e",
    "test_api",
    "test_serve_plans_any_cpu",
    "test_compiled_decode",
    "test_hub",
    "test_serve_fuzz",
    "test_predict_e2e",
    "test_multinode",
    "test_tune_e2e",
    "test_backends",
    "test_openai_clients",
    "test_openai_llamacpp",
    "test_serve_vlm_steps",
    "test_budget",
    "test_serve_models",
    "test_ray_replicas",
    "test_train_fsdp",
    "test_serve_process",
    "test_catalog",
    "test_serve_continuous",
    "test_paged_architectures",
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _alone(item):
            for mark in [m for m in item.own_markers if m.name == "xdist_group"]:
                item.own_markers.remove(mark)
            item.add_marker(pytest.mark.xdist_group(ALONE))  # the vLLM group's tests are all alone
        elif item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(_module(item)))

    def rank(item: pytest.Item) -> int:
        if _alone(item):
            return 0
        name = _module(item)
        if name == OPENER:
            return 1
        return 2 + (SLOWEST_FIRST.index(name) if name in SLOWEST_FIRST else len(SLOWEST_FIRST))

    items.sort(key=rank)  # stable: each file keeps its own order


def _alone(item: pytest.Item) -> bool:
    return item.get_closest_marker("alone") is not None


def _module(item: pytest.Item) -> str:
    module = getattr(item, "module", None)
    return module.__name__ if module is not None else item.nodeid.split("::")[0]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Set-up, call and tear-down of a test under the run's lock: shared for most tests, exclusive
    for those marked `alone` (tests that measure speed, or whose timing a second worker's load
    would change: accelab's own noise guard sees the other worker and measures again until quiet,
    which made `tune` 4x slower beside it). An alone test followed by another keeps the lock for it."""
    alone = _alone(item)
    with _alone_or_shared(alone, keep=alone and nextitem is not None and _alone(nextitem)):
        item.stash[_CPU_AT_START] = _cpu_s()
        return (yield)


# The CPU a test used, its own process's and its ended children's (a module's servers count in the
# test whose tear-down stops them), as the junit property `cpu_s`: on 2 cores the suite is bound
# by CPU, not by waiting, and tools/suite_times.py sums it per file to show what to cut.
_CPU_AT_START = pytest.StashKey[float]()


def _cpu_s() -> float:
    mine, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return mine.ru_utime + mine.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    if call.when == "teardown" and _CPU_AT_START in item.stash:  # the last report: junit reads its properties
        item.user_properties.append(("cpu_s", round(_cpu_s() - item.stash[_CPU_AT_START], 1)))
    return (yield)


class _Lock:
    """A readers-writer lock over two files, for the workers of one xdist run. A writer first takes
    the turnstile and keeps it while it waits and runs, so readers queue behind it instead of
    passing it one after another (flock has no writer preference)."""

    def __init__(self, run: str):
        base = os.path.join(tempfile.gettempdir(), f"accelab-pytest-{run}")
        self.turnstile = os.open(base + ".turn", os.O_CREAT | os.O_RDWR, 0o600)
        self.shared = os.open(base + ".lock", os.O_CREAT | os.O_RDWR, 0o600)
        self.held_alone = False  # this worker kept it from the alone test before


@functools.cache
def _run_lock(run: str) -> _Lock:
    return _Lock(run)


@contextlib.contextmanager
def _alone_or_shared(alone: bool, keep: bool = False) -> Iterator[None]:
    """Hold the run's lock for one test: shared, or exclusive for an alone test; `keep` holds the
    exclusive lock on for the next test (an alone one) instead of letting the other worker in."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # the same in every worker of one run
    if run is None:  # one process: nothing runs beside a test
        yield
        return
    lock = _run_lock(run)
    if not lock.held_alone:
        fcntl.flock(lock.turnstile, fcntl.LOCK_EX)
        fcntl.flock(lock.shared, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(lock.turnstile, fcntl.LOCK_UN)
    lock.held_alone = alone and keep
    try:
        yield
    finally:
        if not lock.held_alone:
            fcntl.flock(lock.shared, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(lock.turnstile, fcntl.LOCK_UN)
