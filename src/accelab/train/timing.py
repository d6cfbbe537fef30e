"""Step timing of a training run. Pure: the clock and the device sync are injected.

Each optimizer step's duration is the wall time from the end of the previous step to the end
of this one, so data loading counts; evaluation and checkpointing are paused out. The first
`warmup` steps (first calls, compilation, allocator growth) are left out of the throughput:

    samples/s = (timed steps x global batch) / (sum of the timed steps' durations)

which is samples over the wall time of the timed steps, never all samples over one step's mean.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from accelab.measure.stats import summarize
from accelab.train.step_split import StepSplit


@dataclass(kw_only=True, slots=True)
class StepTimer:
    warmup: int
    clock: Callable[[], float] = time.perf_counter
    sync: Callable[[], None] = lambda: None  # torch.cuda.synchronize on GPUs: kernels finish before the clock is read
    durations: list[float] = field(default_factory=list)
    epochs: list[int] = field(default_factory=list)  # the epoch of each step
    split: StepSplit | None = None  # where each step's time goes (bench rows), on this timer's step boundaries
    _last: float | None = None

    def start(self) -> None:
        self.sync()
        self._last = self.clock()
        if self.split is not None:
            self.split.restart(self._last)

    def step_done(self, epoch: int) -> float:
        assert self._last is not None, "StepTimer.start() first"
        self.sync()
        now = self.clock()
        duration, self._last = now - self._last, now
        self.durations.append(duration)
        if self.split is not None:
            self.split.step_done(now)
        self.epochs.append(epoch)
        return duration

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside (eval, checkpoints) counts toward no step."""
        try:
            yield
        finally:
            self.start()

    def epoch_seconds(self, epoch: int) -> float:
        return sum(d for d, e in zip(self.durations, self.epochs) if e == epoch)

    def summary(self, global_batch: int, steps_per_epoch: int, full_epochs: list[int]) -> dict[str, object]:
        """Throughput over the timed steps and the epoch time: the last full epoch's training
        time when one ran in this process, else an estimate from the median step (flagged)."""
        timed = self.durations[self.warmup :]
        wall = sum(timed)
        step_ms = summarize([d * 1000 for d in timed]).to_dict() if timed else None
        out: dict[str, object] = {
            "steps": len(self.durations),
            "timed_steps": len(timed),
            "timed_samples": len(timed) * global_batch,
            "timed_wall_s": wall,
            "warmup_s": sum(self.durations[: self.warmup]),  # first calls, incl. compilation
            "samples_per_s": len(timed) * global_batch / wall if wall > 0 else None,
            "step_ms": step_ms,
        }
        if self.split is not None:
            out["split"] = self.split.summary(self.warmup)
        if full_epochs:
            out["epoch_s"], out["epoch_s_estimated"] = self.epoch_seconds(full_epochs[-1]), False
        elif step_ms is not None:  # steps were timed
            out["epoch_s"] = step_ms["p50"] / 1000 * steps_per_epoch
            out["epoch_s_estimated"] = True
        else:
            out["epoch_s"], out["epoch_s_estimated"] = None, False
        return out
