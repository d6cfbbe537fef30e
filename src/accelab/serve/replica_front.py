"""The front of `accelab serve --replicas N` (see `accelab.serve.replicas`): the HTTP ingress that
forwards each request to a replica through a Ray Serve DeploymentHandle (Ray spreads them) and
streams the answer back, and the one `/metrics` over all replicas.

A replica that dies takes its requests with it; the front gives each of them exactly one answer:
a request that had sent nothing yet is retried once on another replica, and one that had (a
stream) ends with a 503 error event. `/metrics` merges the replicas' posts under one schema, each
series labelled with its `replica`; `/readyz` is 200 while one replica or more is ready.

What crosses from the front to a replica (`Forwarded`, then `Head` and body chunks back) is
defined here; Ray is imported only inside the functions that need it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

# the routes' annotations (Request) are resolved in this module's globals
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from accelab.serve.errors import error_body
from accelab.serve.metrics import CONTENT_TYPE_LATEST, FrontMetrics

log = logging.getLogger(__name__)

APP_NAME = "accelab"
BOARD_NAME = "accelab-metrics-board"
STALE_AFTER_S = 10.0  # a replica silent this long (dead) leaves /metrics


@dataclass(frozen=True, slots=True)
class Forwarded:
    """One HTTP request, as the front hands it to a replica (picklable)."""

    method: str
    path: str
    query: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes


@dataclass(frozen=True, slots=True)
class Head:
    """The first item a replica streams back: the status line and headers."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]


def lost_replica_errors() -> tuple[type[BaseException], ...]:
    """Ray's errors that say the replica is gone (its actor, worker process or node died, or it
    cannot be placed): a request that got no answer from it may go to another. A RayTaskError
    that wraps one of them is an instance of it too (Ray makes it a subclass of its cause)."""
    from ray import exceptions

    return (
        exceptions.RayActorError,  # ActorDiedError, ActorUnavailableError
        exceptions.ActorUnschedulableError,
        exceptions.WorkerCrashedError,
        exceptions.NodeDiedError,
        exceptions.LocalRayletDiedError,
        exceptions.OwnerDiedError,
    )


def merge_metrics(posts: dict[str, tuple[str, int]], front: Any = None) -> bytes:
    """Every replica's series under one schema, each with a `replica` label (and the replica's
    process id in `accelab_replica_info`), then the front's own (`FrontMetrics`: retries)."""
    families: dict[str, Metric] = {}
    for replica, (text, _pid) in sorted(posts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(
                family.name, Metric(family.name, family.documentation, family.type, family.unit)
            )
            for sample in family.samples:
                merged.add_sample(sample.name, {"replica": replica, **sample.labels}, sample.value, sample.timestamp)
    info = GaugeMetricFamily(
        "accelab_replica_info",
        f"Replicas reporting in the last {STALE_AFTER_S:g} s (value 1), with their process ids.",
        labels=["replica", "pid"],
    )
    for replica, (_text, pid) in sorted(posts.items()):
        info.add_metric([replica, str(pid)], 1)

    class _Merged:
        def collect(self) -> list[Metric]:
            return [*families.values(), info, *(front.registry.collect() if front is not None else ())]

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())
    return generate_latest(registry)


# -- the front ----------------------------------------------------------------------------------
class Front:
    """The ingress deployment's class: `build_front` makes its app. It is bound with the model
    deployment so that one `serve.run` starts both; the routes reach the replicas by name."""

    def __init__(self, replicas: Any):
        self.replicas = replicas


def build_front() -> Any:
    """The ingress app: /livez itself, /metrics merged, everything else forwarded."""
    from ray import serve

    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    counts = FrontMetrics()
    replicas = serve.get_deployment_handle("ModelReplica", app_name=APP_NAME)
    lost = lost_replica_errors()

    @app.get("/livez")
    async def livez() -> dict[str, str]:
        return {"status": "alive"}

    @app.get("/readyz")
    async def readyz() -> Response:
        import ray

        ready = await ray.get_actor(BOARD_NAME, namespace=APP_NAME).ready.remote(STALE_AFTER_S)
        body = {"status": "ready" if ready else "loading", "replicas_ready": ready}
        return Response(_json(body), status_code=200 if ready else 503, media_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        import ray

        board = ray.get_actor(BOARD_NAME, namespace=APP_NAME)
        posts = await board.live.remote(STALE_AFTER_S)
        counts.replicas_configured.set(await board.replicas_configured.remote())
        return Response(merge_metrics(posts, counts), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request) -> Response:
        forwarded = Forwarded(
            method=request.method,
            path=request.url.path,
            query=request.url.query.encode(),
            headers=tuple((k.lower(), v) for k, v in request.headers.raw),
            body=await request.body(),
        )
        return await _answer(replicas, forwarded, counts, lost)

    return app


async def _answer(
    replicas: Any, forwarded: Forwarded, counts: FrontMetrics, lost: tuple[type[BaseException], ...]
) -> Response:
    """A replica's answer to `forwarded`, streamed; a replica that dies before answering gets
    one retry on another, then a 503."""
    from ray.serve.handle import DeploymentResponseGenerator

    for attempt in (1, 2):
        stream = replicas.options(stream=True).forward.remote(forwarded)
        assert isinstance(stream, DeploymentResponseGenerator), "a streaming handle's call streams"
        try:
            head = await stream.__anext__()
            first = await _next_or_none(stream)
        except lost as err:
            log.warning(
                "a replica died before answering (%s); %s",
                type(err).__name__,
                "retrying on another" if attempt == 1 else "answering 503",
            )
            if attempt == 1:
                counts.replica_retries.inc()
            continue
        headers = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in head.headers
            if k.lower() not in (b"content-length", b"transfer-encoding")
        }
        return StreamingResponse(_rest(first, stream, counts, lost), status_code=head.status, headers=headers)
    counts.replica_lost.labels(when="before_answer").inc()
    return Response(
        _json(
            error_body(
                503,
                "the replica serving this request died, and so did a retry; send it again (Ray restarts replicas)",
                code="replica_died",
            )
        ),
        status_code=503,
        media_type="application/json",
        headers={"Retry-After": "1"},
    )


async def _next_or_none(stream: Any) -> bytes | None:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


async def _rest(
    first: bytes | None, stream: Any, counts: FrontMetrics, lost: tuple[type[BaseException], ...]
) -> AsyncIterator[bytes]:
    """The body after its first chunk; a replica that dies mid-stream (`lost`: Ray's errors that
    say so) ends it with a 503 event."""
    if first is not None:
        yield first
    try:
        async for chunk in stream:
            yield chunk
    except lost:
        counts.replica_lost.labels(when="mid_stream").inc()
        body = error_body(
            503, "the replica serving this stream died mid-answer; send the request again", code="replica_died"
        )
        yield f"data: {_json(body)}\n\ndata: [DONE]\n\n".encode()


def _json(doc: dict[str, Any]) -> str:
    return json.dumps(doc)
