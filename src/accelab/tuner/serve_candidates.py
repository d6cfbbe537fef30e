"""The candidate servers of a serving tune: one `accelab serve` process per plan, started in a
session of its own (stopping it stops the engine processes it started: vLLM's worker), watched
for readiness, and sampled for the memory of its whole process tree while it lives."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

MIB = 2**20


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(kw_only=True)
class CandidateServer:
    """`accelab serve MODEL --plan REF` with the tune's server settings, on a free port."""

    key: str  # the plan reference, as `accelab serve --plan` takes it
    model: str  # what `accelab serve` is given
    served_name: str
    settings: dict[str, int]  # --max-batch-size and the like
    extra_args: tuple[str, ...] = ()
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None
    log: Path | None = None
    peak_rss_mb: float = 0.0
    error: str | None = None  # why it did not start, or died
    worker_pids: tuple[int, ...] = ()  # other processes running its model, as its /readyz says

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "accelab", "serve", self.model, "--plan", self.key, "--port", str(self.port)]
        cmd += ["--served-name", self.served_name]
        for name, value in self.settings.items():
            cmd += [f"--{name.replace('_', '-')}", str(value)]
        return [*cmd, *self.extra_args]

    def start(self, logs: Path) -> None:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.key)
        self.log = logs / f"{safe}.log"
        with open(self.log, "wb") as out:  # the child keeps its own handle
            self.process = subprocess.Popen(
                self.command(),
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,
            )

    def log_tail(self, chars: int = 1500) -> str:
        if self.log is None or not self.log.exists():
            return ""
        return self.log.read_text(errors="replace")[-chars:].strip()

    def poll_ready(self) -> bool | None:
        """True once /readyz answers 200; None when the process exited (self.error says why)."""
        assert self.process is not None
        if self.process.poll() is not None:
            self.error = f"exited with code {self.process.returncode}: {self.log_tail()}"
            return None
        with contextlib.suppress(httpx.TransportError):
            answer = httpx.get(f"{self.url}/readyz", timeout=5)
            if answer.status_code == 200:
                self.worker_pids = tuple(answer.json().get("worker_pids", ()))
                return True
        return False

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def processes(self) -> list[psutil.Process]:
        """The server, every process it started, and the processes its /readyz names as running
        its model (vLLM's engine, which a server may share with an earlier run), with theirs."""
        if not self.alive:
            return []
        assert self.process is not None
        found: dict[int, psutil.Process] = {}
        for pid in (self.process.pid, *self.worker_pids):
            with contextlib.suppress(psutil.NoSuchProcess):
                root = psutil.Process(pid)
                for proc in (root, *root.children(recursive=True)):
                    found[proc.pid] = proc
        return list(found.values())

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes()]

    def rss_mb(self) -> float:
        """Resident memory of the server and every process it started, MiB."""
        total = 0
        for proc in self.processes():
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                total += proc.memory_info().rss
        return total / MIB

    def stop(self) -> None:
        if self.process is not None:
            stop_session(self.process)


def stop_session(process: subprocess.Popen) -> None:
    """SIGTERM to a process started in a session of its own (and so to everything it started),
    SIGKILL after a minute."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


def wait_all_ready(servers: list[CandidateServer], timeout_s: float) -> None:
    """Until every server is ready or has failed (its `error` set); past the timeout the ones
    still loading fail with the reason."""
    deadline = time.monotonic() + timeout_s
    pending = [s for s in servers if s.error is None]
    while pending:
        pending = [s for s in pending if s.poll_ready() is False]
        if pending and time.monotonic() > deadline:
            for server in pending:
                server.error = f"not ready after {timeout_s:.0f} s: {server.log_tail(600)}"
                server.stop()
            return
        if pending:
            time.sleep(1.0)


class MemoryWatch:
    """Samples each live server's process-tree RSS every `interval_s` in a thread and keeps its
    peak in `server.peak_rss_mb` (start-up included: a server killed for memory while it loads
    never serves)."""

    def __init__(self, servers: list[CandidateServer], interval_s: float = 0.25):
        self._servers = servers
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="accelab-tune-memory", daemon=True)

    def __enter__(self) -> MemoryWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def sample(self) -> None:
        for server in self._servers:
            server.peak_rss_mb = max(server.peak_rss_mb, server.rss_mb())

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.sample()
