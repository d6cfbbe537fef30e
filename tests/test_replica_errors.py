"""The Ray Serve front (accelab.serve.replicas) knows a dead replica by Ray's error classes, not
by their text: a stream that loses its replica ends with a 503 event, any other error goes on
up. On fake streams, in milliseconds (tests/test_ray_replicas.py kills a real replica)."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("ray", reason="the [ray] extra")  # Ray is optional: its imports come after

from ray import exceptions

from accelab.serve.metrics import FrontMetrics
from accelab.serve.replica_front import _rest, lost_replica_errors


class DyingStream:
    """A replica's answer stream that sends `chunks`, then raises `error`."""

    def __init__(self, chunks: list[bytes], error: BaseException):
        self.chunks, self.error = list(chunks), error

    def __aiter__(self) -> DyingStream:
        return self

    async def __anext__(self) -> bytes:
        if self.chunks:
            return self.chunks.pop(0)
        raise self.error


def drain(stream: DyingStream, counts: FrontMetrics) -> list[bytes]:
    async def run() -> list[bytes]:
        return [chunk async for chunk in _rest(b"first", stream, counts, lost_replica_errors())]

    return asyncio.run(run())


def lost_mid_stream(counts: FrontMetrics) -> float | None:
    return counts.registry.get_sample_value("accelab_replica_lost_requests_total", {"when": "mid_stream"})


@pytest.mark.parametrize(
    "error",
    [
        exceptions.ActorDiedError(),
        exceptions.ActorUnavailableError("the node is gone", b"1" * 16),
        exceptions.WorkerCrashedError(),
        exceptions.NodeDiedError("node died"),
        exceptions.RayTaskError("forward", "traceback", exceptions.ActorDiedError()).as_instanceof_cause(),
    ],
    ids=lambda e: type(e).__name__,
)
def test_a_lost_replica_ends_the_stream_with_a_503_event(error):
    counts = FrontMetrics()
    chunks = drain(DyingStream([b"second"], error), counts)
    assert chunks[:2] == [b"first", b"second"]
    event = json.loads(chunks[2].decode().split("\n\n")[0].removeprefix("data: "))
    assert event["error"]["code"] == "replica_died" and chunks[2].endswith(b"data: [DONE]\n\n")
    assert lost_mid_stream(counts) == 1


def test_other_errors_are_not_taken_for_a_lost_replica_even_when_they_say_died():
    counts = FrontMetrics()
    with pytest.raises(ValueError, match="the model died"):
        drain(DyingStream([], ValueError("the model died")), counts)
    with pytest.raises(exceptions.RayTaskError):  # the replica's own code failed: not retried
        drain(DyingStream([], exceptions.RayTaskError("forward", "traceback", KeyError("x"))), counts)
    assert lost_mid_stream(counts) == 0
