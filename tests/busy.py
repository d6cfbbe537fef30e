"""A real competing process for noise tests and benchmarks: a busy loop on one core, switched
on and off (on_s busy, off_s asleep, repeated), as another user's job on a shared machine.

It runs in its own process group, outside the caller's process tree (a sibling of what it
disturbs, so the measured process cannot mistake its CPU time for its own), and is killed when
the block ends.

    with switching_load(on_s=3, off_s=4):
        subprocess.run(["accelab", "compare", ...])
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

LOOP = """
import os, sys, time
on_s, off_s, core = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
if core >= 0 and hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, {core})
while True:
    end = time.monotonic() + on_s
    while time.monotonic() < end:
        pass
    if off_s > 0:
        time.sleep(off_s)
"""


@contextlib.contextmanager
def switching_load(*, on_s: float, off_s: float, core: int = -1) -> Iterator[int]:
    """A busy loop on `core` (-1: wherever the kernel puts it), busy on_s then idle off_s, over
    and over, for the duration of the block; yields its pid."""
    proc = subprocess.Popen(
        [sys.executable, "-c", LOOP, str(on_s), str(off_s), str(core)],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield proc.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
