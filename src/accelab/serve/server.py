"""Run the app under uvicorn with a graceful stop.

SIGTERM (or Ctrl+C): /readyz turns 503 and new requests get 503 at once, requests in flight
finish (queued ones run too), then the server exits, all within `grace_period_s`. A second
signal stops at once. The process exits 0 after a signal, 1 when the model failed to load.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from accelab import cpu
from accelab.serve import allocator
from accelab.serve.config import ServeConfig
from accelab.serve.engines import build_engine
from accelab.serve.engines.interfaces import Engine
from accelab.serve.state import ServerState

log = logging.getLogger(__name__)

SHUTDOWN_RESERVE_S = 1.0  # of the grace period, kept for closing connections and the worker


def engine_factory(
    spec: Any, plan: Any, device: Any, *, name: str, max_batch_size: int | None = None
) -> Callable[[], Engine]:
    """`build_engine` for the server's background loader thread."""
    return lambda: build_engine(spec, plan, device, name=name, max_batch_size=max_batch_size)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, *, state: ServerState, grace_s: float):
        super().__init__(config)
        self.state = state
        self.grace_s = grace_s
        self.exit_code = 0
        self._drain_requested = False
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: it runs on the main (event loop) thread between two bytecodes, so it
        # only sets flags; on_tick starts the drain from inside the loop. Unlike uvicorn's own
        # handler it does not re-raise the signal at the end, so the exit status is 0.
        if self._drain_requested:
            log.warning("second signal: stopping now")
            self.should_exit = self.force_exit = True
            return
        self._drain_requested = True

    def request_stop(self, exit_code: int) -> None:
        """Stop without draining (the model failed to load); callable from any thread."""
        self.exit_code = exit_code
        self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self._drain_requested and self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drain())
        return await super().on_tick(counter)

    async def _drain(self) -> None:
        started = time.monotonic()
        in_flight = self.state.in_flight
        log.warning(
            "stopping: new requests get 503; finishing %d in flight (grace period %g s)", in_flight, self.grace_s
        )
        self.state.begin_drain()
        if not await self.state.wait_idle(max(0.0, self.grace_s - SHUTDOWN_RESERVE_S)):
            log.warning("grace period over with %d requests still in flight; stopping anyway", self.state.in_flight)
        else:
            log.warning("in-flight requests finished in %.1f s", time.monotonic() - started)
        self.should_exit = True


def run_server(
    config: ServeConfig,
    factory: Callable[[], Engine],
    *,
    access_log: bool = False,
    announce: Callable[[str], None] | None = None,
) -> int:
    """Serve until a signal; returns the exit status. Binds before loading the model, so
    /livez answers (and /readyz says 503) while it loads."""
    from accelab.serve.app import create_app

    _enable_logs()
    allocator.keep_freed_memory()
    say = announce or (lambda line: print(line, file=sys.stderr, flush=True))
    app = create_app(config, factory, stop_timeout_s=SHUTDOWN_RESERVE_S / 2)
    state: ServerState = app.state.accelab
    sock = _bind(config.host, config.port)
    host, port = sock.getsockname()[:2]
    uv_config = uvicorn.Config(
        app,
        log_config=None,
        access_log=access_log,
        lifespan="on",
        # uvicorn annotates whole seconds but waits with asyncio.wait_for, which takes half of one
        timeout_graceful_shutdown=max(0.1, SHUTDOWN_RESERVE_S / 2),  # type: ignore[arg-type]
        timeout_keep_alive=5,
    )
    server = DrainingServer(uv_config, state=state, grace_s=config.grace_period_s)
    state.on_load_failure = lambda reason: server.request_stop(exit_code=1)
    say(
        f"accelab serve: {config.model_name} (plan {config.plan_name}) listening on http://{host}:{port} "
        f"(loading; /readyz turns 200 when ready); CPU {cpu.described()}"
    )
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    say(f"accelab serve: stopped (exit {server.exit_code})")
    if state.threads_alive():  # a model call or load still running: daemon threads in torch must not
        logging.shutdown()  # race the interpreter's teardown
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(server.exit_code)
    return server.exit_code


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ValueError(
            f"cannot listen on {host}:{port}: {err.strerror}; pick another --port (0: any free one)"
        ) from None
    sock.listen(2048)  # accept (into the backlog) from now on: the URL is printed before uvicorn starts
    sock.set_inheritable(True)
    return sock


def _enable_logs() -> None:
    """The server's own steps (loading, ready, draining) at INFO, whatever the CLI's level."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    serve_log = logging.getLogger("accelab.serve")
    if serve_log.level == logging.NOTSET:
        serve_log.setLevel(logging.INFO)
