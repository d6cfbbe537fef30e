"""`accelab serve MODEL --replicas N`: the same server, N times, on Ray Serve (a local Ray
instance, or a cluster with `--ray-address`), behind one HTTP address.

Two deployments:
- `ModelReplica` (N replicas): each runs accelab's own app in-process (engine, batcher or
  continuous scheduler, limits, errors) and answers forwarded requests by driving that ASGI app;
  it takes requests once its model is loaded, and every second it posts its Prometheus text to
  the `MetricsBoard` actor;
- `Front` (the HTTP ingress, `accelab.serve.replica_front`): forwards each request to a replica,
  streaming the answer back, with one retry on another replica for a request that got nothing
  from a replica that died (Ray restarts it), and merges the replicas' metrics.

Ray is an optional dependency (`pip install accelab[ray]`); nothing here imports it at module
level, so the rest of the server never needs it: its errors are recognised by their classes,
imported where Ray is (`replica_front.lost_replica_errors`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, MutableMapping
from typing import Any

from accelab.serve.config import ServeConfig
from accelab.serve.replica_front import APP_NAME, BOARD_NAME, Forwarded, Front, Head, build_front

log = logging.getLogger(__name__)

POST_EVERY_S = 1.0  # how often a replica posts its metrics


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

        task = asyncio.create_task(self.app(_scope(request), receive, send))
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


def _scope(request: Forwarded) -> dict[str, Any]:
    """The ASGI scope of a forwarded request, as a server would make it."""
    return {
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
        app = _application(serve, config, factory, replicas)
        say(
            f"accelab serve: {config.model_name} (plan {config.plan_name}) on {replicas} Ray Serve replica(s) "
            f"listening on http://{config.host}:{port} (loading; /readyz turns 200 when a replica is ready)"
        )
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        _wait_for_signal()
        say("accelab serve: stopping the replicas (in-flight requests finish first)")
        serve.delete(APP_NAME)
        ray.kill(board)
        return 0
    finally:
        serve.shutdown()
        ray.shutdown()


def _application(serve: Any, config: ServeConfig, factory: Callable[[], Any], replicas: int) -> Any:
    """The two deployments, bound: the front in front of `replicas` model replicas."""
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
    return front.bind(model.bind(config, factory))


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
