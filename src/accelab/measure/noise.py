"""What the machine did besides a measurement, read around each timed window.

On a shared VM or a laptop, another process on one core, or the hypervisor giving the core to
another guest, changes a figure several-fold without a trace in the figure itself. So every
timed window records what else happened while it ran:

- **CPU steal**: the share of all CPU time the hypervisor gave to other guests (`/proc/stat`,
  the `steal` column of the `cpu` line, over the window);
- **other processes**: CPU time the rest of the machine used, in cores' worth over the window
  (the machine's busy time from `/proc/stat` minus the CPU time of the processes that measure:
  the measuring child, its workers, and the accelab process that drives them);
- **throttling**: the share of the window the cgroup's CPU quota held the processes back
  (cgroup v2 `cpu.stat` throttled_usec, v1 `cpu.stat` throttled_time);
- **load**: the 1-minute load average, for the record;
- the measurement's own **spread** (coefficient of variation of its calls), added by the caller.

Thresholds (documented in docs/measurement.md, "How accelab measures"; a window past a NOISY figure is noted,
past an UNRELIABLE one its figures are not trusted: compare drops its rounds, the probes do not
cache a verdict measured in it):

| figure                    | noisy   | unreliable |
|---------------------------|---------|------------|
| CPU steal                 | >= 3%   | >= 10%     |
| other processes           | >= 0.10 | >= 0.30 cores |
| cgroup throttling         | >= 2%   | >= 10%     |
| spread (cv of the calls)  | >= 10%  | (never alone: a model can be that variable) |

The figures of a window are pure functions of two snapshots (`window`), so they are tested
with fake `/proc/stat` readings; only `snapshot` reads the machine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import psutil

Level = Literal["quiet", "noisy", "unreliable"]
LEVELS: tuple[Level, ...] = ("quiet", "noisy", "unreliable")

NOISY = {"steal": 0.03, "others_cores": 0.10, "throttled": 0.02, "cv": 0.10}
UNRELIABLE = {"steal": 0.10, "others_cores": 0.30, "throttled": 0.10}

PROC_STAT = Path("/proc/stat")
PROC_LOADAVG = Path("/proc/loadavg")
CGROUP_STATS = (
    Path("/sys/fs/cgroup/cpu.stat"),
    Path("/sys/fs/cgroup/cpu/cpu.stat"),
    Path("/sys/fs/cgroup/cpu,cpuacct/cpu.stat"),
)


@dataclass(frozen=True, kw_only=True, slots=True)
class CpuTicks:
    """The `cpu` line of /proc/stat, in clock ticks (guest time is already inside user/nice)."""

    user: int
    nice: int
    system: int
    idle: int
    iowait: int
    irq: int
    softirq: int
    steal: int

    @property
    def busy(self) -> int:
        return self.user + self.nice + self.system + self.irq + self.softirq

    @property
    def total(self) -> int:
        return self.busy + self.idle + self.iowait + self.steal


def parse_proc_stat(text: str) -> CpuTicks:
    """The aggregate `cpu` line of a /proc/stat text."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            values = [int(v) for v in fields[1:9]] + [0] * max(0, 8 - len(fields[1:9]))
            return CpuTicks(
                user=values[0],
                nice=values[1],
                system=values[2],
                idle=values[3],
                iowait=values[4],
                irq=values[5],
                softirq=values[6],
                steal=values[7],
            )
    raise ValueError("no aggregate 'cpu' line in /proc/stat")


def parse_throttled_seconds(text: str) -> float:
    """Throttled time from a cgroup cpu.stat: v2 `throttled_usec`, v1 `throttled_time` (ns)."""
    fields = dict(line.split()[:2] for line in text.splitlines() if len(line.split()) >= 2)
    if "throttled_usec" in fields:
        return int(fields["throttled_usec"]) / 1e6
    if "throttled_time" in fields:
        return int(fields["throttled_time"]) / 1e9
    return 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Snapshot:
    """The machine at one instant: what a window's figures are differences of."""

    wall: float  # time.monotonic()
    ticks: CpuTicks
    own_cpu_s: float  # CPU seconds of the measuring processes so far (user + system)
    throttled_s: float
    load1: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Window:
    """What the machine did besides the measurement during one timed window."""

    seconds: float
    steal: float  # fraction of all CPU time, 0..1
    others_cores: float  # cores' worth of CPU used by other processes
    throttled: float  # fraction of the window
    load1: float
    cv: float | None = None  # the measurement's own spread, when the caller knows it

    def with_cv(self, cv: float | None) -> Window:
        return Window(
            seconds=self.seconds,
            steal=self.steal,
            others_cores=self.others_cores,
            throttled=self.throttled,
            load1=self.load1,
            cv=cv,
        )

    @property
    def level(self) -> Level:
        return classify(self)[0]

    @property
    def reason(self) -> str:
        return classify(self)[1]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "level": self.level, "reason": self.reason}


def window(before: Snapshot, after: Snapshot, *, hz: int = 100, cores: int | None = None) -> Window:
    """The figures between two snapshots. `hz`: clock ticks per second of /proc/stat.

    Both the machine's counters and the processes' CPU times advance in whole ticks (10 ms
    at 100 Hz), per core: a window can see one tick per core more or less than happened. That
    much is forgiven (`slack`), so a 20 ms window does not report "3 cores of other processes"
    from one stray tick; a window this short tells little either way, and callers measure
    windows of a few hundred milliseconds or more."""
    seconds = max(after.wall - before.wall, 1e-9)
    slack = cores or 1  # ticks
    total = after.ticks.total - before.ticks.total
    stolen = max(0, after.ticks.steal - before.ticks.steal - slack)
    steal = stolen / total if total > 0 else 0.0
    busy_s = (after.ticks.busy - before.ticks.busy) / hz
    others = max(0.0, busy_s - (after.own_cpu_s - before.own_cpu_s) - slack / hz) / seconds
    if cores is not None:
        others = min(others, float(cores))
    return Window(
        seconds=seconds,
        steal=min(max(steal, 0.0), 1.0),
        others_cores=others,
        throttled=min(max((after.throttled_s - before.throttled_s) / seconds, 0.0), 1.0),
        load1=after.load1,
    )


def classify(w: Window) -> tuple[Level, str]:
    """(level, why) of one window by the thresholds of the module docstring."""
    figures = {"steal": w.steal, "others_cores": w.others_cores, "throttled": w.throttled}
    over = [name for name, value in figures.items() if value >= UNRELIABLE[name]]
    if over:
        return "unreliable", _describe(w, over)
    noisy = [name for name, value in figures.items() if value >= NOISY[name]]
    if w.cv is not None and w.cv >= NOISY["cv"]:
        noisy.append("cv")
    if noisy:
        return "noisy", _describe(w, noisy)
    return "quiet", ""


def _describe(w: Window, names: Iterable[str]) -> str:
    text = {
        "steal": f"{w.steal * 100:.0f}% CPU steal",
        "others_cores": f"other processes used {w.others_cores:.2f} cores",
        "throttled": f"the cgroup throttled the CPU {w.throttled * 100:.0f}% of the time",
        "cv": f"calls spread {(w.cv or 0) * 100:.0f}% (cv)",
    }
    return ", ".join(text[n] for n in names)


def worst(windows: Sequence[Window]) -> Window | None:
    """The window that says the most about how loud the machine was (highest level, then
    the most steal and other processes)."""
    if not windows:
        return None
    return max(windows, key=lambda w: (LEVELS.index(w.level), loudness(w)))


def loudness(w: Window) -> float:
    """One number for how much a window took from a measurement: steal, other processes (a
    quarter each core) and throttling."""
    return w.steal + w.others_cores / 4 + w.throttled


def summary(windows: Sequence[Window], kept: Sequence[bool] | None = None) -> dict[str, Any]:
    """The `noise` record of a Result: the mean and the worst of its windows, and how many of
    its rounds its figures come from (`kept`: the rounds not dropped as unreliable). The row
    is as loud as the loudest round it kept; with none kept it is unreliable."""
    if not windows:
        return {}
    kept = list(kept) if kept is not None else [True] * len(windows)
    used = [w for w, k in zip(windows, kept) if k]
    bad = worst(windows)
    assert bad is not None
    n = len(windows)
    level: Level = max((w.level for w in used), key=LEVELS.index) if used else "unreliable"
    return {
        "level": level,
        "reason": bad.reason,
        "steal": sum(w.steal for w in windows) / n,
        "steal_max": max(w.steal for w in windows),
        "others_cores": sum(w.others_cores for w in windows) / n,
        "others_cores_max": max(w.others_cores for w in windows),
        "throttled": sum(w.throttled for w in windows) / n,
        "load1": max(w.load1 for w in windows),
        "cv": bad.cv,
        "rounds": n,
        "rounds_used": len(used),
    }


# -- reading the machine ---------------------------------------------------------------------------
def _cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU seconds of these processes and all their living descendants."""
    seen: set[int] = set()
    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for proc in tree:
            if proc.pid in seen:
                continue
            seen.add(proc.pid)
            try:
                t = proc.cpu_times()
            except psutil.Error:
                continue
            total += t.user + t.system + t.children_user + t.children_system
    return total


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def snapshot(pids: Iterable[int] = ()) -> Snapshot | None:
    """The machine now, with `pids` (default: this process) as the measuring processes; None
    where /proc/stat cannot be read (not Linux): the figures are then simply not recorded."""
    text = _read(PROC_STAT)
    if text is None:
        return None
    throttled = next((parse_throttled_seconds(t) for p in CGROUP_STATS if (t := _read(p)) is not None), 0.0)
    load = _read(PROC_LOADAVG)
    return Snapshot(
        wall=time.monotonic(),
        ticks=parse_proc_stat(text),
        own_cpu_s=_cpu_seconds(list(pids) or [os.getpid()]),
        throttled_s=throttled,
        load1=float(load.split()[0]) if load else 0.0,
    )


def clock_ticks() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (ValueError, OSError, AttributeError):
        return 100


class Meter:
    """Snapshots around a block: `with Meter(pids) as m: ...; m.window` (None off Linux)."""

    def __init__(self, pids: Iterable[int] = ()) -> None:
        self.pids = list(pids)
        self.window: Window | None = None
        self._before: Snapshot | None = None

    def __enter__(self) -> Meter:
        self._before = snapshot(self.pids)
        return self

    def __exit__(self, *exc: object) -> None:
        after = snapshot(self.pids)
        if self._before is not None and after is not None:
            self.window = window(self._before, after, hz=clock_ticks(), cores=os.cpu_count())


def settle(pids: Iterable[int], *, idle_cores: float = 0.1, step_s: float = 0.1, timeout_s: float = 5.0) -> float:
    """Wait until `pids` (and their children) go idle: a plan's engine may keep its threads
    spinning for a second or more after its turn (vLLM CPU's workers: half a core), which the next
    plan's turn would meet as another process's load. Returns the seconds waited (at most
    `timeout_s`: an engine that never idles is then the next window's noise, measured as such)."""
    pids = list(pids)
    start = last_t = time.monotonic()
    last_cpu = _cpu_seconds(pids)
    while time.monotonic() - start < timeout_s:
        time.sleep(step_s)
        now, cpu = time.monotonic(), _cpu_seconds(pids)
        if cpu - last_cpu <= idle_cores * (now - last_t):
            break
        last_t, last_cpu = now, cpu
    return time.monotonic() - start


def sample_now(seconds: float = 1.0) -> Window | None:
    """How loud the machine is right now: a window of `seconds` in which accelab does nothing
    (this process only sleeps), so everything busy is someone else's."""
    with Meter() as meter:
        time.sleep(seconds)
    return meter.window


def busy_warning(now: Window | None) -> str | None:
    """What a command says before it measures, when the machine is already loud (None: quiet)."""
    if now is None or now.level == "quiet":
        return None
    return (
        f"the machine is {'busy' if now.level == 'unreliable' else 'noisy'} before the run: {now.reason} "
        f"(load {now.load1:.1f}). Every round's noise is measured and rounds past the thresholds are left "
        "out; rows without enough quiet rounds will say 'unreliable'"
    )


def warn_if_busy(echo: Callable[[str], None], seconds: float = 0.5) -> Window | None:
    """Sample the machine for `seconds` and `echo` the warning when it is already loud."""
    now = sample_now(seconds)
    if (text := busy_warning(now)) is not None:
        echo(text)
    return now
