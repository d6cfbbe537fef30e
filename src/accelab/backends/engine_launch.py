"""Starting, or reusing, an engine process that runs in a venv of its own (vLLM's, OpenVINO
GenAI's) and speaks `engine_wire` over a Unix socket.

An engine is keyed by what it runs (its caller hashes model files, engine config, venv and code);
its socket sits at a fixed path for that key under `runtime_dir(kind)`, so every measuring child of
a compare or tune finds the engine the first one started, and a lock file makes one start per key
however many children ask at once. The socket appears only once the engine is ready.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


KEEP_S_DEFAULT = 600.0


def keep_seconds(variable: str) -> float:
    """How long an engine for measurements outlives its last client: `variable` from the
    environment, else 600 s."""
    raw = os.environ.get(variable)
    if raw is None:
        return KEEP_S_DEFAULT
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{variable}={raw!r} must be a number of seconds (0: stop with the last client)") from None
    if value < 0:
        raise ValueError(f"{variable}={raw!r} must be 0 or more seconds")
    return value


def model_stamp(model: str) -> list[tuple[str, int, int]]:
    path = Path(model)
    files = [p for p in path.iterdir() if p.is_file()] if path.is_dir() else []
    return sorted((p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in files)


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineAddress:
    socket: Path
    log: Path
    key: str


def runtime_dir(kind: str) -> Path:
    """Short on purpose: a Unix socket's path must fit in 107 bytes. One folder per kind of engine,
    so a test that stops the vLLM engines it started never stops another runtime's.
    `ACCELAB_RUNTIME_DIR` moves them (the system's temporary directory by default): processes that
    share it share engines, so a job can keep its engines to itself."""
    path = Path(os.environ.get("ACCELAB_RUNTIME_DIR") or tempfile.gettempdir()) / f"accelab-{kind}-{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def try_connect(path: Path) -> socket.socket | None:
    if not path.exists():
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except OSError:
        sock.close()
        return None
    return sock


def connect_or_start(
    *, kind: str, key: str, command: Sequence[str], env: dict[str, str], name: str, timeout_s: float
) -> tuple[socket.socket, EngineAddress]:
    """A connected socket to the engine `key`: the running one, else `command --socket PATH`
    started now (in its own session, output to the key's log). RuntimeError with the engine's last
    log lines when it exits or is not ready within `timeout_s`."""
    base = runtime_dir(kind) / key
    address = EngineAddress(socket=base.with_suffix(".sock"), log=base.with_suffix(".log"), key=key)
    with locked(base.with_suffix(".lock")):
        sock = try_connect(address.socket)
        if sock is not None:
            log.info("reusing %s %s (%s)", name, key, address.socket)
            return sock, address
        address.socket.unlink(missing_ok=True)  # a dead engine's socket
        log.info("starting %s %s; log %s", name, key, address.log)
        with open(address.log, "wb") as out:
            # its own session: an engine kept for later measurements outlives the child that started
            # it, and a Ctrl-C of accelab's process group does not tear it down half-way
            process = subprocess.Popen(
                [*command, "--socket", str(address.socket)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        return _wait_ready(process, address, timeout_s, name), address


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock between processes, held while the block runs."""
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _wait_ready(process: subprocess.Popen, address: EngineAddress, timeout_s: float, name: str) -> socket.socket:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sock = try_connect(address.socket)
        if sock is not None:
            return sock
        if process.poll() is not None:
            raise RuntimeError(
                f"the {name} exited with {process.returncode} before it was ready; its log "
                f"({address.log}) ends:\n{log_tail(address.log)}"
            )
        time.sleep(0.5)
    process.terminate()
    raise RuntimeError(
        f"the {name} was not ready after {timeout_s:.0f} s (stopped it); its log ({address.log}) "
        f"ends:\n{log_tail(address.log)}"
    )


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    useful = [line for line in text if not line.startswith("WARNING: Location")]  # pip's noise on this machine
    return "\n".join(useful[-lines:])
