"""A vision encoder that runs in slices between the continuous steps.

Encoding a 512 px image through SmolVLM-256M's vision tower takes 0.25-0.9 s on a 2-core CPU: run
whole inside a step, it holds every decoding sequence and every text request waiting for its
first token that long. Here an image's encoding is cut between the tower's transformer layers,
and inside each before its MLP (the norm there): after a step the engine gives the encoder a time
slice, the encoder runs half-layer after half-layer until the slice is spent, and the next step
runs with the encoding paused where it was. A text prompt that arrives meanwhile waits for half a
layer at most (SmolVLM-256M's tower in bf16, two images a forward: ~18 ms instead of ~36).

The model's own forward is not rewritten to be resumable: it runs in a greenlet (a coroutine
with its own C stack, on the step thread itself), and a forward pre-hook on each of the tower's
layers switches back to the step once the slice is over. Not a helper thread: a second thread
that runs torch ops gets an OpenMP team of its own, and with more OpenMP threads than cores
libgomp stops spinning at its barriers, which made every later decoding step 2x slower here
(27 -> 54 ms for 8 SmolLM2 sequences, for as long as the server ran). The hooks do nothing in
any other greenlet: the model's own forward elsewhere (the start-up check) runs whole.

Torch's grad mode and autocast are thread state, which greenlets share: the step side enters
them around each switch into the encoder, so the encoder always runs under them and the step
side leaves them as it found them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import greenlet
import torch

from accelab.serve.runner.vision import ImageBatch, ImageInput, batch_images

__all__ = ["Encoded", "SlicedEncoder", "encode_wanted"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Encoded:
    """An image whose encoding ended: its features (or the error it raised), and the encoder
    time it took over all its slices."""

    key: str
    features: torch.Tensor | None
    error: BaseException | None
    seconds: float


class SlicedEncoder:
    """One batch of images at a time (`current`); `run` gives it a slice. `encode(batch)` is the
    model's whole encoding of a batch (anything with a `key`); `layers` the modules between which
    it may pause; `context` the model's run context (autocast and the like)."""

    def __init__(
        self,
        encode: Callable[[Any], torch.Tensor],
        layers: torch.nn.ModuleList,
        context: Callable[[], AbstractContextManager[Any]],
    ):
        self._encode, self._context = encode, context
        self._image: Any = None
        self._coroutine: greenlet.greenlet | None = None
        self._deadline = math.inf
        self._interrupt: Callable[[], bool] | None = None
        self._layer_run = False  # the slice under way has run a part (each runs one at least)
        self._spent = 0.0
        self.slices = 0  # slices run, over all images
        self._hooks = [part.register_forward_pre_hook(self._between) for part in pause_points(layers)]

    @property
    def current(self) -> Any:
        """The image whose encoding has begun and not ended (None: none)."""
        return self._image

    def run(self, image: Any, budget_s: float | None, interrupt: Callable[[], bool] | None = None) -> Encoded | None:
        """Encode `image` (it must be `current` when one is) for about `budget_s` seconds
        (None: to the end; at least half a layer per slice), pausing early at a pause point once
        `interrupt()` says so. The result once it ended, else None."""
        if self._image is None:
            self._image, self._spent = image, 0.0
            self._coroutine = greenlet.greenlet(self._encode)
        elif self._image is not image:
            raise ValueError("another image's encoding is under way: finish it first")
        assert self._coroutine is not None
        started = time.perf_counter()
        self._deadline = math.inf if budget_s is None else started + budget_s
        self._interrupt = interrupt
        self._layer_run = False
        self.slices += 1
        features: torch.Tensor | None = None
        error: BaseException | None = None
        try:
            with torch.inference_mode(), self._context():
                features = self._coroutine.switch(image)  # back here at a pause, or with the features
        except Exception as err:  # noqa: BLE001 - the image's requests fail with it, the others go on
            error = err
        self._spent += time.perf_counter() - started
        if error is None and not self._coroutine.dead:
            return None  # paused between layers
        self._image, self._coroutine = None, None
        return Encoded(key=image.key, features=features, error=error, seconds=self._spent)

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        coroutine, self._coroutine, self._image = self._coroutine, None, None
        if coroutine is not None and not coroutine.dead and coroutine.parent is greenlet.getcurrent():
            coroutine.throw(greenlet.GreenletExit)  # unwinds the paused forward here, on its own thread

    def _between(self, module: torch.nn.Module, args: Any) -> None:
        """Before each pause point, inside the encoder's greenlet: back to the step once the slice is spent."""
        coroutine = self._coroutine
        if coroutine is None or greenlet.getcurrent() is not coroutine:
            return
        if self._layer_run and (
            time.perf_counter() >= self._deadline or (self._interrupt is not None and self._interrupt())
        ):
            assert coroutine.parent is not None
            coroutine.parent.switch()
        self._layer_run = True


_BEFORE_MLP = ("layer_norm2", "post_attention_layernorm", "ln_2")  # a layer's norm between attention and MLP


def pause_points(layers: torch.nn.ModuleList) -> list[torch.nn.Module]:
    """Where an encoding may pause: before each layer, and inside it before its MLP (the norm
    there, which the layer's own forward and the packed one both call as a module)."""
    points: list[torch.nn.Module] = []
    for layer in layers:
        points.append(layer)
        norm = next(
            (getattr(layer, n) for n in _BEFORE_MLP if isinstance(getattr(layer, n, None), torch.nn.Module)), None
        )
        if norm is not None:
            points.append(norm)
    return points


def encode_wanted(
    slices: SlicedEncoder,
    cache: Any,
    wanted: Sequence[tuple[int, ImageInput]],
    budget_s: float | None,
    *,
    batch: int = 1,
    interrupt: Callable[[], bool] | None = None,
) -> dict[str, BaseException]:
    """Encode the images the prefill waits for (`wanted`: (sequence, image), oldest first) for
    about `budget_s` seconds (None: all of them; half a layer at least), up to `batch` images in one
    forward (`vision.batch_images`): the batch begun first goes on first (its work is never thrown
    away), then the others in order. A finished image goes into `cache` (the engine's
    vision.EncoderCache), held by the sequences that want it. The encoder pauses at a pause point
    once `interrupt()` says so (a text prompt became due). A batch that fails is encoded again
    image by image, so that an image fails alone. Returns the errors of images whose encoding
    failed, by image key."""
    if batch < 1:
        raise ValueError(f"batch={batch}: the encoder takes one image a forward at least")
    current: ImageBatch | None = slices.current
    begun = {image.key for image in current.images} if current is not None else set()
    waiting: dict[str, ImageInput] = {}
    for _, image in wanted:
        if image.key not in cache and image.key not in begun:
            waiting.setdefault(image.key, image)
    queue = ([current] if current is not None else []) + batch_images(list(waiting.values()), batch)
    failed: dict[str, BaseException] = {}
    deadline = None if budget_s is None else time.perf_counter() + budget_s
    for i, work in enumerate(queue):
        left = None if deadline is None else deadline - time.perf_counter()
        if left is not None and left <= 0 and i:  # every call moves on by half a layer at least
            break
        done = slices.run(work, left, interrupt)
        if done is None:
            break
        if done.error is not None and len(work.images) > 1:  # which image it was: each alone, to its end
            for image in work.images:
                alone = ImageBatch(images=(image,), inputs=image.inputs)
                result = slices.run(alone, None)
                assert result is not None
                _settle(result, alone, cache, wanted, failed)
            continue
        _settle(done, work, cache, wanted, failed)
    return failed


def _settle(
    done: Encoded,
    work: ImageBatch,
    cache: Any,
    wanted: Sequence[tuple[int, ImageInput]],
    failed: dict[str, BaseException],
) -> None:
    """An ended batch: each image's features into the cache with its share of the time, or its error."""
    if done.error is not None:
        failed.update((image.key, done.error) for image in work.images)
        return
    assert done.features is not None
    for image, features in zip(work.images, work.split(done.features), strict=True):
        holders = [seq for seq, other in wanted if other.key == image.key]
        cache.add(image.key, features, holders, done.seconds * image.rows / work.rows)
