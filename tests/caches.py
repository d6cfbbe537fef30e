"""Private caches (ACCELAB_CACHE=a temporary directory) that start with this machine's measured
limits. bench, compare, tune and train's MFU read `hardware.json` from the cache and measure the
machine when their entry is missing: 20-40 s each time, and longer beside the other test worker,
whose load makes the measurement wait for a quiet window. The limits are measured once, in the
user's cache, and each private cache starts with a copy."""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

import pytest

from accelab.backends.engine_launch import locked

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

    USER_CACHE.mkdir(parents=True, exist_ok=True)
    with pytest.MonkeyPatch.context() as mp, locked(USER_CACHE / "hardware.json.lock"):
        mp.setenv("ACCELAB_CACHE", str(USER_CACHE))
        threads = torch.get_num_threads()
        try:
            for count in THREAD_COUNTS:
                torch.set_num_threads(count)
                hardware_limits("cpu")  # the cached entry, or measured and cached
        finally:
            torch.set_num_threads(threads)
    return USER_CACHE / "hardware.json"
