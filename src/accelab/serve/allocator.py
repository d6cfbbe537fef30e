"""glibc's malloc keeps the memory the engine frees, for its next tensors of that size.

By default glibc hands a freed block above its mmap threshold back to the kernel, and trims the
free top of its heaps: the next tensor of that size is fresh pages again, each faulted in and
zeroed by the kernel. SmolVLM-256M's vision tower (bf16, one 512 px image, this 2-core VM) took
~42,000 minor page faults an image that way, and 333-344 ms; with the threshold fixed at 32 MiB
(glibc's most) and the heaps trimmed only past 256 MiB free: no faults after the first image,
300-310 ms. vLLM's CPU server gets the same from tcmalloc, which its launcher preloads.

The cost: the process keeps its peak heap in memory after a burst instead of returning it
(what tcmalloc and jemalloc do too). Elsewhere than glibc (macOS, musl) nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20  # glibc's upper limit on 64-bit systems: blocks above it are still mmap'd
TRIM_THRESHOLD = 256 << 20  # free heap top kept before glibc gives it back


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed blocks for reuse; False where the C library is not glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    done = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if done:
        log.info(
            "malloc keeps freed memory for reuse (mmap threshold %d MiB, trim threshold %d MiB)",
            MMAP_THRESHOLD >> 20,
            TRIM_THRESHOLD >> 20,
        )
    return done
