"""From a route handler to the worker and back: prepare inputs off the event loop, submit a
job (429 when the queue is full), wait for it with the request's deadline (504), and turn
the worker's outcome into an answer or the right error."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, MutableMapping
from concurrent.futures import Future
from typing import Any, TypeVar

from starlette.types import Receive

from accelab.serve.batcher import QueueFull
from accelab.serve.engines.base import ContextTooLong, FieldNotSupported, PayloadTooLarge
from accelab.serve.errors import ApiError
from accelab.serve.images import ImageRefused, ImageTooLarge
from accelab.serve.jobs import Job, JobOutcome, ShuttingDown
from accelab.serve.state import ServerState

R = TypeVar("R")


INLINE_CHARS = 20_000  # text up to this long is tokenised on the event loop; longer goes to a thread


async def prepare(
    fn: Callable[[], R], *, offload: bool, between_steps: Callable[[Callable[[], R]], Future[R]] | None = None
) -> R:
    """Run `fn` (tokenising, templating, decoding images); ValueError -> 422, longer than the
    model takes or a field the engine cannot honour -> 400, past a server limit -> 413.

    `offload` runs it in a thread: for images (PIL decoding, image processors, milliseconds)
    and long texts (a megabyte takes the tokenizer most of a second). Short text goes inline:
    a fast tokenizer takes microseconds, less than the hop to a thread and back, which also
    has to win the GIL from the model worker (up to the 5 ms switch interval).
    `between_steps` runs it on the worker's thread instead, between two of its steps
    (`ServerState.image_preparer`: a thread beside the steps would stall them).
    """
    try:
        if between_steps is not None:
            return await asyncio.wrap_future(between_steps(fn))
        return await asyncio.to_thread(fn) if offload else fn()
    except ShuttingDown:
        raise shutting_down() from None
    except (PayloadTooLarge, ImageTooLarge) as err:
        raise ApiError(413, str(err)) from None
    except ContextTooLong as err:
        raise ApiError(400, str(err), kind="too_long") from None
    except (FieldNotSupported, ImageRefused) as err:
        raise ApiError(400, str(err)) from None
    except ValueError as err:
        raise ApiError(422, str(err)) from None


def shutting_down() -> ApiError:
    return ApiError(
        503,
        "the server is shutting down; send the request to another replica",
        kind="shutting_down",
        headers={"Retry-After": "1"},
    )


def long_text(texts: list[Any]) -> bool:
    return sum(len(t) for t in texts if isinstance(t, str)) > INLINE_CHARS


def check_count(what: str, count: int, limit: int) -> None:
    if count > limit:
        raise ApiError(
            413,
            f"{count} {what} in one request; this server takes at most {limit} (--max-inputs); "
            "split them over several requests",
        )


class Submission:
    """One job in the worker, seen from the event loop. Created in a handler (needs its loop)."""

    def __init__(
        self,
        state: ServerState,
        *,
        key: str,
        units: list[Any],
        run: Callable[[list[Any]], list[Any]],
        arrival: float | None = None,
        scope: MutableMapping[str, Any] | None = None,
    ):
        self.state = state
        self.arrival = arrival if arrival is not None else time.monotonic()
        self.deadline = self.arrival + state.config.request_timeout_s
        loop = asyncio.get_running_loop()
        self.outcome: asyncio.Future[JobOutcome] = loop.create_future()
        self.started: asyncio.Future[None] = loop.create_future()
        job = Job(
            key=key,
            units=units,
            run=run,
            done=_threadsafe(loop, self.outcome),
            started=_threadsafe(loop, self.started, None),
            timeout_s=max(0.0, self.deadline - time.monotonic()),
        )
        self.executor = state.executor(key)
        if scope is not None:  # before the worker wakes up: it may then start without waiting for company
            state.submitted(scope)
        try:
            self.pending = self.executor.submit(job)
        except QueueFull:
            retry = self.executor.retry_after_s()
            raise ApiError(
                429,
                f"the server is at capacity: {self.executor.depth} requests are queued "
                f"(--max-queue {state.config.max_queue}); retry after {retry} s",
                headers={"Retry-After": str(retry)},
            ) from None
        except (PayloadTooLarge, ImageTooLarge) as err:
            raise ApiError(413, str(err)) from None
        except ShuttingDown:
            raise shutting_down() from None

    async def wait_started(self) -> None:
        """Until its batch starts (or it ended): a stream's status code is decided by then."""
        await self._wait([self.started, self.outcome])
        if self.outcome.done():
            self._raise_for(self.outcome.result())

    async def result(self, receive: Receive | None = None) -> JobOutcome:
        """The outcome. With `receive` (the ASGI channel, body already read) a client that hangs
        up stops the wait, and its job is dropped if still queued: an overloaded server sheds
        the work of clients that timed out instead of running it for nobody. (Not for streams:
        the streaming response listens for the disconnect itself.)"""
        watcher = asyncio.ensure_future(_disconnect(receive)) if receive is not None else None
        try:
            await self._wait([self.outcome], watcher)
        finally:
            if watcher is not None:
                watcher.cancel()
        outcome = self.outcome.result()
        self._raise_for(outcome)
        self._observe(outcome)
        return outcome

    def abandon(self) -> None:
        """The client went away: drop the job if it is still queued."""
        if not self.outcome.done():
            self.executor.cancel(self.pending)

    async def _wait(self, futures: list[asyncio.Future], watcher: asyncio.Future | None = None) -> None:
        waiting = futures + ([watcher] if watcher is not None else [])
        remaining = self.deadline - time.monotonic()
        done, _ = await asyncio.wait(waiting, timeout=max(0.0, remaining), return_when=asyncio.FIRST_COMPLETED)
        if not done:
            if self.executor.cancel(self.pending):  # still queued at its deadline: never run
                raise self._timeout_error()
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)  # running: answer coming
        if watcher is not None and watcher in done and not any(f.done() for f in futures):
            self.abandon()
            raise ApiError(499, "the client closed the connection before the answer", kind="client_gone")

    def _timeout_error(self) -> ApiError:
        waited = time.monotonic() - self.arrival
        return ApiError(
            504,
            f"the request waited {waited:.1f} s without starting, past its deadline of "
            f"{self.state.config.request_timeout_s:g} s (--request-timeout); the server is overloaded: "
            "retry later or raise --request-timeout",
        )

    def _raise_for(self, outcome: JobOutcome) -> None:
        if outcome.ok:
            return
        if outcome.error_kind == "timeout":
            raise self._timeout_error()
        if outcome.error_kind == "oom":
            raise ApiError(
                500, f"out of memory even when run alone ({outcome.error}); send a smaller input", kind="oom"
            )
        raise ApiError(
            500,
            f"the model failed on this request: {type(outcome.error).__name__}: {outcome.error}",
            kind="model_error",
        )

    def _observe(self, outcome: JobOutcome) -> None:
        m = self.state.metrics
        m.queue_time.observe(outcome.queue_s)
        m.compute_time.observe(outcome.compute_s)


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _threadsafe(loop: asyncio.AbstractEventLoop, future: asyncio.Future, value: Any = ...) -> Callable[..., None]:
    """A callback for the worker thread that resolves `future` on its loop."""

    def resolve(result: Any = None) -> None:
        def set_() -> None:
            if not future.done():
                future.set_result(value if value is not ... else result)

        try:
            loop.call_soon_threadsafe(set_)
        except RuntimeError:  # the loop is closed: the server is gone, nobody waits
            pass

    return resolve
