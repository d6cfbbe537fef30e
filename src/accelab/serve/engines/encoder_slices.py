"""A vision encoder that runs in slices between the continuous steps.

Encoding a 512 px image through SmolVLM-256M's vision tower takes 0.25-0.9 s on a 2-core CPU: run
whole inside a step, it holds every decoding sequence and every text request waiting for its
first token that long. Here an image's encoding is cut between the tower's transformer layers:
after a step the engine gives the encoder a time slice, the encoder runs layer after layer until
the slice is spent, and the next step runs with the encoding paused where it was.

The model's own forward is not rewritten to be resumable: it runs on a helper thread, and a
forward pre-hook on each of the tower's layers parks that thread once its slice is over, until
the step thread hands it the next one. The two threads never compute at once (the step thread
waits while the encoder runs), so the encoder has every core while it runs, as it would inline.
The hooks do nothing on any other thread: the model's own forward elsewhere (the start-up check)
runs whole.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Encoded", "SlicedEncoder"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Encoded:
    """An image whose encoding ended: its features (or the error it raised), and the encoder
    time it took over all its slices."""

    key: str
    features: torch.Tensor | None
    error: BaseException | None
    seconds: float


class _Closed(Exception):
    """Unwinds a parked encoding when the engine closes."""


class SlicedEncoder:
    """One image at a time (`current`); `run` gives it a slice. `encode(image)` is the model's
    whole encoding of one image; `layers` the modules between which it may pause; `context`
    the model's run context (autocast and the like), entered on the helper thread."""

    def __init__(
        self,
        encode: Callable[[Any], torch.Tensor],
        layers: torch.nn.ModuleList,
        context: Callable[[], AbstractContextManager[Any]],
    ):
        self._encode, self._context = encode, context
        self._go = threading.Semaphore(0)  # step thread -> encoder: run a slice
        self._back = threading.Semaphore(0)  # encoder -> step thread: slice over (or encoding done)
        self._image: Any = None
        self._result: torch.Tensor | BaseException | None = None
        self._deadline = math.inf
        self._spent = 0.0
        self._closing = False
        self.slices = 0  # slices run, over all images
        self._thread = threading.Thread(target=self._loop, name="accelab-vision-encoder", daemon=True)
        self._hooks = [layer.register_forward_pre_hook(self._between) for layer in layers]
        self._thread.start()

    @property
    def current(self) -> Any:
        """The image whose encoding has begun and not ended (None: none)."""
        return self._image

    def run(self, image: Any, budget_s: float | None) -> Encoded | None:
        """Encode `image` (it must be `current` when one is) for about `budget_s` seconds
        (None: to the end; at least one layer per slice). The result once it ended, else None."""
        if self._closing:
            raise RuntimeError("the vision encoder is closed")
        if self._image is None:
            self._image, self._spent = image, 0.0
        elif self._image is not image:
            raise ValueError("another image's encoding is under way: finish it first")
        started = time.perf_counter()
        self._deadline = math.inf if budget_s is None else started + budget_s
        self.slices += 1
        self._go.release()
        self._back.acquire()
        self._spent += time.perf_counter() - started
        result = self._result
        if result is None:
            return None
        self._image, self._result = None, None
        if isinstance(result, BaseException):
            return Encoded(key=image.key, features=None, error=result, seconds=self._spent)
        return Encoded(key=image.key, features=result, error=None, seconds=self._spent)

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._closing = True
        self._go.release()  # a parked encoding unwinds; an idle loop returns
        self._thread.join(timeout=10)

    # -- the helper thread ----------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            self._go.acquire()
            if self._closing:
                return
            try:
                with torch.inference_mode(), self._context():
                    features: torch.Tensor | BaseException = self._encode(self._image)
            except _Closed:
                return
            except BaseException as err:  # noqa: BLE001 - the step thread fails the image's requests with it
                features = err
            self._result = features
            self._back.release()

    def _between(self, module: torch.nn.Module, args: Any) -> None:
        """Before each layer, on the helper thread: park once the slice is spent."""
        if threading.current_thread() is not self._thread or time.perf_counter() < self._deadline:
            return
        self._back.release()
        self._go.acquire()
        if self._closing:
            raise _Closed
