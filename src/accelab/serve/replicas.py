"""`accelab serve MODEL --replicas N`: the same server, N times, on Ray Serve (a local Ray
instance, or a cluster with `--ray-address`), behind one HTTP address.

Two deployments:
- `ModelReplica` (N replicas): each runs accelab's own app in-process (engine, batcher or
  continuous scheduler, limits, errors) and answers forwarded requests by driving that ASGI app;
  it takes requests once its model is loaded, and every second it posts its Prometheus text to
  the `MetricsBoard` actor;
- `Front` (the HTTP ingress): forwards each request to a replica through a DeploymentHandle
  (Ray spreads them), streaming the answer back. A replica that dies takes its requests with
  it; the front gives each of them exactly one answer: a request that had sent nothing yet is
  retried once on another replica, and one that had (a stream) ends with a 503 error event.
  Ray restarts the dead replica. `/metrics` merges the replicas' posts under one schema, each
  series labelled with its `replica`; `/readyz` is 200 while one replica or more is ready.

Ray is an optional dependency (`pip install accelab[ray]`); nothing here imports it at module
level, so the rest of the server never needs it: its errors are recognised by their classes,
imported where Ray is (`lost_replica_errors`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

# the routes' annotations (Request) are resolved in this module's globals
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from accelab.serve.config import ServeConfig
from accelab.serve.errors import error_body
from accelab.serve.metrics import CONTENT_TYPE_LATEST, FrontMetrics

log = logging.getLogger(__name__)

APP_NAME = "accelab"
BOARD_NAME = "accelab-metrics-board"
POST_EVERY_S = 1.0  # how often a replica posts its metrics
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


def require_ray() -> Any:
    try:
        import ray  # noqa: F401 - Ray itself, not only its serve package, must import
        from ray import serve
    except ImportError:
        raise ValueError(
            "--replicas and --ray-address need Ray Serve: pip install 'accelab[ray]' (or pip install 'ray[serve]')"
        ) from None
    return serve


# -- a replica --------------------------------------------------------------------------------
class ModelReplica:
    """accelab's app, run in-process: `forward` drives it with one request's ASGI messages."""

    def __init__(self, config: ServeConfig, factory: Callable[[], Any]):
        from ray import serve

        from accelab.serve.app import create_app

        self.replica = serve.get_replica_context().replica_id.unique_id
        self.app = create_app(config, factory)
        self.state = self.app.state.accelab
        self.state.start()  # the app's lifespan: the worker, and the model loading in the background
        self._closed = threading.Event()
        threading.Thread(target=self._post_metrics, name="accelab-metrics-post", daemon=True).start()
        log.info("replica %s (pid %d) loading %s", self.replica, os.getpid(), config.model_name)
        # Ray routes requests to a replica once __init__ returns: return when the model is ready
        while self.state.status == "loading":
            time.sleep(0.05)
        if self.state.status == "failed":
            self._closed.set()
            raise RuntimeError(f"replica {self.replica} could not load {config.model_name}: {self.state.load_error}")

    async def forward(self, request: Forwarded) -> AsyncIterator[Head | bytes]:
        """The answer: a Head, then the body in chunks (several for a stream)."""
        messages: asyncio.Queue[MutableMapping[str, Any]] = asyncio.Queue()
        gone = asyncio.Event()
        body_sent = False

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await gone.wait()  # the front's client went away (the call was cancelled)
            return {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            await messages.put(message)

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": request.method,
            "scheme": "http",
            "path": request.path,
            "raw_path": request.path.encode(),
            "query_string": request.query,
            "root_path": "",
            "headers": list(request.headers),
            "client": ("ray", 0),
            "server": ("replica", 0),
            "state": {},
        }
        task = asyncio.create_task(self.app(scope, receive, send))
        try:
            while True:
                getter = asyncio.ensure_future(messages.get())
                done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:  # the app ended without another message
                    getter.cancel()
                    if messages.empty():
                        task.result()  # re-raise what the app raised
                        return
                    continue
                message = getter.result()
                if message["type"] == "http.response.start":
                    yield Head(status=message["status"], headers=tuple(message.get("headers", ())))
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield bytes(message["body"])
                    if not message.get("more_body", False):
                        return
        finally:
            gone.set()  # a stream stops its sequences; an unfinished call is abandoned
            if not task.done():
                try:
                    await asyncio.wait_for(task, 5.0)
                except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - the answer is gone anyway
                    task.cancel()

    def check_health(self) -> None:
        """Ray Serve calls this; raising makes it restart the replica."""
        if self.state.status == "failed":
            raise RuntimeError(f"the model failed to load: {self.state.load_error}")

    def _post_metrics(self) -> None:
        import ray

        board = None
        while not self._closed.wait(POST_EVERY_S):
            try:
                board = board or ray.get_actor(BOARD_NAME, namespace=APP_NAME)
                board.post.remote(
                    self.replica, self.state.metrics.render().decode(), os.getpid(), self.state.status == "ready"
                )
            except Exception:  # noqa: BLE001 - the board may be gone during shutdown
                board = None

    def __del__(self) -> None:
        closed = getattr(self, "_closed", None)
        if closed is not None:
            closed.set()
            self.state.stop(timeout_s=5.0)


class MetricsBoard:
    """A small Ray actor: the latest Prometheus text each replica posted, and when."""

    def __init__(self, configured: int = 0) -> None:
        self.posts: dict[str, tuple[float, str, int, bool]] = {}
        self._configured = configured  # --replicas

    def replicas_configured(self) -> int:
        return self._configured

    def post(self, replica: str, text: str, pid: int, ready: bool) -> None:
        self.posts[replica] = (time.time(), text, pid, ready)

    def live(self, max_age_s: float) -> dict[str, tuple[str, int]]:
        now = time.time()
        return {replica: (text, pid) for replica, (at, text, pid, _) in self.posts.items() if now - at <= max_age_s}

    def ready(self, max_age_s: float) -> int:
        now = time.time()
        return sum(1 for at, _, _, ready in self.posts.values() if ready and now - at <= max_age_s)


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
    from ray.serve.handle import DeploymentResponseGenerator

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

    return app


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


# -- running it ------------------------------------------------------------------------------------
def run_replicas(
    config: ServeConfig,
    factory: Callable[[], Any],
    *,
    replicas: int,
    ray_address: str | None,
    announce: Callable[[str], None] | None = None,
) -> int:
    """Serve until SIGTERM or Ctrl+C; returns the exit status."""
    import ray

    serve = require_ray()
    say = announce or (lambda line: print(line, file=sys.stderr, flush=True))
    port = config.port or _free_port(config.host)
    ray.init(
        address=ray_address,
        namespace=APP_NAME,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=None if ray_address else 256 * 1024 * 1024,  # None: the cluster's own
    )
    try:
        serve.start(http_options={"host": config.host, "port": port})
        board = ray.remote(MetricsBoard).options(name=BOARD_NAME, get_if_exists=True, num_cpus=0).remote(replicas)
        assert isinstance(board, ray.actor.ActorHandle), "an actor class's remote() starts an actor"
        model = serve.deployment(
            ModelReplica,
            name="ModelReplica",
            num_replicas=replicas,
            max_ongoing_requests=max(config.max_queue + config.max_batch_size, 8),
            graceful_shutdown_timeout_s=config.grace_period_s,
            health_check_period_s=2.0,
            ray_actor_options={"num_cpus": 0},
        )
        front = serve.deployment(
            serve.ingress(build_front)(Front),
            name="Front",
            max_ongoing_requests=10_000,
            ray_actor_options={"num_cpus": 0},
        )
        say(
            f"accelab serve: {config.model_name} (plan {config.plan_name}) on {replicas} Ray Serve replica(s) "
            f"listening on http://{config.host}:{port} (loading; /readyz turns 200 when a replica is ready)"
        )
        serve.run(front.bind(model.bind(config, factory)), name=APP_NAME, route_prefix="/", blocking=False)
        _wait_for_signal()
        say("accelab serve: stopping the replicas (in-flight requests finish first)")
        serve.delete(APP_NAME)
        ray.kill(board)
        return 0
    finally:
        serve.shutdown()
        ray.shutdown()


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
