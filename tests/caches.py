"""Private caches (ACCELAB_CACHE=a temporary directory) that start with this machine's measured
limits. bench, compare, tune and train's MFU read `hardware.json` from the cache and measure the
machine when their entry is missing: 20-40 s each time, and longer beside the other test worker,
whose load makes the measurement wait for a quiet window. The limits are measured once, in the
user's cache, and each private cache starts with a copy."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

# read at import, before any test points ACCELAB_CACHE elsewhere
USER_CACHE = Path(os.environ.get("ACCELAB_CACHE") or Path.home() / ".cache" / "accelab")
THREAD_COUNTS = (1, 2)  # the runs of the tests: one thread per rank, or both cores


def with_limits(root: Path) -> Path:
    """`root`, created, holding this machine's measured limits; returns it."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(_measured(), root / "hardware.json")
    return root


@functools.cache
def _measured() -> Path:
    """The user's hardware.json with an entry per thread count the tests run at, measured where
    missing (one worker measures, the other waits for it)."""
    import torch

    from accelab.measure.hardware import hardware_limits

    with _user_cache(), _locked(USER_CACHE / "hardware.json.lock"):
        threads = torch.get_num_threads()
        try:
            for count in THREAD_COUNTS:
                torch.set_num_threads(count)
                hardware_limits("cpu")  # the cached entry, or measured and cached
        finally:
            torch.set_num_threads(threads)
    return USER_CACHE / "hardware.json"


@contextlib.contextmanager
def _user_cache() -> Iterator[None]:
    before = os.environ.get("ACCELAB_CACHE")
    os.environ["ACCELAB_CACHE"] = str(USER_CACHE)
    try:
        yield
    finally:
        if before is None:
            del os.environ["ACCELAB_CACHE"]
        else:
            os.environ["ACCELAB_CACHE"] = before


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
