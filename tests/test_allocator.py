"""glibc's malloc set to keep freed memory: a thread that allocates and frees tensors of a few
sizes over and over (an engine's step thread) stops faulting in fresh pages; without the setting
the same loop faults thousands of pages. Each case runs in a process of its own (the setting is
process-wide)."""

from __future__ import annotations

import subprocess
import sys

import pytest

LOOP = """
import resource, sys, threading, torch
from accelab.serve.allocator import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
def work(out):
    sizes = [6 << 20, 12 << 20, 3 << 20, 24 << 20]
    for _ in range(3):  # warm: the heap grows to what the loop needs
        for size in sizes:
            torch.empty(size, dtype=torch.uint8).fill_(1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        for size in sizes:
            torch.empty(size, dtype=torch.uint8).fill_(1)
    out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
out = []
thread = threading.Thread(target=work, args=(out,))
thread.start()
thread.join()
print(kept, out[0])
"""


def faults(mode: str) -> tuple[str, int]:
    done = subprocess.run([sys.executable, "-c", LOOP, mode], capture_output=True, text=True, timeout=120, check=True)
    kept, count = done.stdout.split()
    return kept, int(count)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux")
def test_kept_memory_is_reused_without_page_faults():
    kept, count = faults("keep")
    assert kept == "True" and count < 100
    _, default = faults("default")
    assert default > 1000  # what the setting saves: each loop's 45 MiB faulted in again
