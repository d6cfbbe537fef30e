"""Servers for tests (and the serving benchmarks): `running_server` serves an app in this
process, `ServerProcess` runs one as a child process.

The benchmarks under benchmarks/ import `ServerProcess` from here (they put tests/ on sys.path),
so that it has one copy and the package ships no test harness.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def running_server(app: Any, *, host: str = "127.0.0.1", ready_timeout_s: float = 60.0) -> Iterator[str]:
    """Serve `app` with uvicorn in a background thread on a free port; yields its base URL once
    /readyz answers 200, and always stops the server (and the app's worker) on exit."""
    import httpx
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_config=None, access_log=False, lifespan="on", timeout_graceful_shutdown=1)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="test-server", daemon=True)
    thread.start()
    url = f"http://{host}:{port}"
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError(f"test server at {url} not ready after {ready_timeout_s} s")
            time.sleep(0.02)
        yield url
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


class ServerProcess:
    """`python <args> --port 0` as a child process (`"-m", "accelab.serve", ...` or a script's
    path and its options); reads its URL from the 'listening on' line. Always `stop()` it (or use
    it as a context manager): SIGTERM, then kill."""

    def __init__(self, *args: str, timeout_s: float = 60.0, env: dict[str, str] | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("server did not start:\n" + "".join(self.log)) from None
                continue
            match = re.search(r"listening on (http://[\d.]+:\d+)", line)
            if match:
                self.url = match.group(1)
                return

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            self.lines.put(line)

    def wait_ready(self, timeout_s: float = 120.0) -> list[int]:
        """Poll /readyz until 200; returns the statuses seen (503 while loading)."""
        import httpx

        statuses: list[int] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                statuses.append(httpx.get(f"{self.url}/readyz", timeout=5).status_code)
            except httpx.TransportError:
                statuses.append(0)
            if statuses[-1] == 200:
                return statuses
            time.sleep(0.05)
        raise RuntimeError("server not ready:\n" + "".join(self.log))

    def wait_in_flight(self, n: int, timeout_s: float = 30.0) -> None:
        """Until the server counts n requests in flight (its /metrics): on a slow machine a request
        a thread started half a second ago may not have reached it yet."""
        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            page = httpx.get(f"{self.url}/metrics", timeout=10).text
            line = next(x for x in page.splitlines() if x.startswith("accelab_requests_in_flight "))
            if float(line.split()[1]) >= n:
                return
            assert time.monotonic() < deadline, f"{line} (waited for {n})"
            time.sleep(0.02)

    def wait_draining(self, timeout_s: float = 10.0) -> None:
        """After SIGTERM, until /readyz says 503: the server has seen the signal and refuses new work."""
        import httpx

        deadline = time.monotonic() + timeout_s
        while httpx.get(f"{self.url}/readyz", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "the server never started draining"
            time.sleep(0.02)

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
