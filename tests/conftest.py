"""Fixtures shared by the tests. Helpers that tests import by name live beside this file
(fake_clock.py, fakes_serve.py, serving.py): pytest puts tests/ on sys.path."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
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
# (`pytest.mark.xdist_group("vllm")`) when it shares something with other files. Files are handed
# out slowest first (the order below, from `pytest --durations=0`), so no long file starts last
# while the other worker idles; the rest follow in collection order. A test marked `alone` runs
# with no other test beside it (`_alone_or_shared`).
SLOWEST_FIRST = (
    "test_tune_serve",
    "test_vllm_e2e",
    "test_engine_process_serve",
    "test_openvino_genai_e2e",
    "test_train_e2e",
    "test_custom_models",
    "test_serve_fuzz",
    "test_openai_fields",
    "test_backends",
    "test_quality_e2e",
    "test_bench_e2e",
    "test_tune_e2e",
    "test_api",
    "test_hub",
    "test_hardware",
    "test_openai_llamacpp",
    "test_openai_clients",
    "test_predict_e2e",
    "test_serve_models",
    "test_paged_architectures",
    "test_multinode",
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(_module(item)))

    def rank(item: pytest.Item) -> int:
        name = _module(item)
        return SLOWEST_FIRST.index(name) if name in SLOWEST_FIRST else len(SLOWEST_FIRST)

    items.sort(key=rank)  # stable: each file keeps its own order


def _module(item: pytest.Item) -> str:
    module = getattr(item, "module", None)
    return module.__name__ if module is not None else item.nodeid.split("::")[0]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Set-up, call and tear-down of a test under the run's lock: shared for most tests, exclusive
    for those marked `alone` (tests that measure speed, or whose timing a second worker's load
    would change: accelab's own noise guard sees the other worker and measures again until quiet,
    which made `tune` 4x slower beside it)."""
    with _alone_or_shared(item.get_closest_marker("alone") is not None):
        return (yield)


class _Lock:
    """A readers-writer lock over two files, for the workers of one xdist run. A writer first takes
    the turnstile and keeps it while it waits and runs, so readers queue behind it instead of
    passing it one after another (flock has no writer preference)."""

    def __init__(self, run: str):
        base = os.path.join(tempfile.gettempdir(), f"accelab-pytest-{run}")
        self.turnstile = os.open(base + ".turn", os.O_CREAT | os.O_RDWR, 0o600)
        self.shared = os.open(base + ".lock", os.O_CREAT | os.O_RDWR, 0o600)


@functools.cache
def _run_lock(run: str) -> _Lock:
    return _Lock(run)


@contextlib.contextmanager
def _alone_or_shared(alone: bool) -> Iterator[None]:
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # the same in every worker of one run
    if run is None:  # one process: nothing runs beside a test
        yield
        return
    lock = _run_lock(run)
    fcntl.flock(lock.turnstile, fcntl.LOCK_EX)
    fcntl.flock(lock.shared, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
    if not alone:
        fcntl.flock(lock.turnstile, fcntl.LOCK_UN)
    try:
        yield
    finally:
        fcntl.flock(lock.shared, fcntl.LOCK_UN)
        if alone:
            fcntl.flock(lock.turnstile, fcntl.LOCK_UN)
