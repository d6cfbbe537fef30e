"""Intra-op threads per training process on CPU, chosen from the CPUs idle at launch.

Why not torch's default (one thread per CPU): OpenMP threads meet at a barrier after every op,
so when another program holds a core, each op waits for the descheduled thread's next time
slice. Measured on this project's shared 2-core machine with vit-tiny (batch 16), while other
work kept ~1.5 cores busy: 2 threads 4.8 samples/s, 1 thread 120 samples/s. On an idle machine
every core is idle and the default is unchanged. An explicit `--threads N` always wins; the
choice is recorded in the Result (`threads_per_process`) and said in a note.
"""

from __future__ import annotations

import logging
import os

import psutil

log = logging.getLogger(__name__)

SAMPLE_S = 0.5  # how long CPU use is sampled before the run


def affinity() -> list[int]:
    """The CPUs this process may run on (containers narrow the host's set)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return list(range(os.cpu_count() or 1))


def idle_cpus(sample_s: float = SAMPLE_S) -> float:
    """CPUs of our affinity set left idle by everything running now (0.0 .. len(affinity))."""
    busy = psutil.cpu_percent(interval=sample_s, percpu=True)  # blocks sample_s; the host's CPUs
    mine = affinity()
    return sum(1.0 - busy[i] / 100.0 for i in mine if i < len(busy))


def threads_per_process(nproc: int, explicit: int | None, idle: float) -> int:
    """--threads when given, else the idle CPUs shared among this node's processes (at least 1). Pure."""
    if explicit is not None:
        return explicit
    return max(1, round(idle) // nproc)


def note(nproc: int, threads: int, idle: float, cpus: int) -> str:
    return (
        f"{threads} intra-op thread(s) per process: {idle:.1f} of {cpus} CPUs were idle at launch, shared by "
        f"{nproc} process(es); pass --threads N to choose"
    )
