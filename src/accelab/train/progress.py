"""What a training run shows while it trains: a rich bar over optimizer steps, or eval lines only."""

from __future__ import annotations

import contextlib
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class NoProgress:
    """No bar; eval lines still printed by the main process (people wait for them)."""

    def __init__(self, main: bool):
        self._main = main

    def advance(self, loss: float, lr: float) -> None:
        pass

    def say(self, message: str) -> None:
        if self._main:
            print(message, flush=True)


class RichProgress:
    """A rich progress bar over optimizer steps (main process only)."""

    def __init__(self, total: int, done: int):
        self._progress = Progress(
            TextColumn("train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[status]}"),
        )
        self._task = self._progress.add_task("train", total=total, completed=done, status="")

    def __enter__(self) -> RichProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def advance(self, loss: float, lr: float) -> None:
        self._progress.update(self._task, advance=1, status=f"loss {loss:.4f}  lr {lr:.2e}")

    def say(self, message: str) -> None:
        self._progress.console.print(message)


def progress_for(session: Any, start: Any) -> contextlib.AbstractContextManager:
    """A bar on the main process (unless --no-progress), else eval lines only. `session`: a
    loop.Session, `start`: the loop.Position it resumes at."""
    if session.config.progress and session.accelerator.is_main_process:
        return RichProgress(session.total_steps, start.global_step)
    return contextlib.nullcontext(NoProgress(session.accelerator.is_main_process))
