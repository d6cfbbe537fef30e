"""Engine processes (vLLM's, OpenVINO GenAI's) that a test module starts through `accelab`
commands, kept to that module: its commands run with a runtime directory of its own
(`ACCELAB_RUNTIME_DIR`), so they never attach to, nor stop, an engine that a test on another
worker started meanwhile (a server's engine, say), and every engine left in it is stopped at the
module's end."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def engine_pid(path: Path) -> int | None:
    """The pid an engine's socket says it runs in (None: nobody listens there)."""
    from accelab.backends import engine_wire as W

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
        return W.decode(sock.makefile("rb").readline()).pid
    except OSError:
        return None
    finally:
        sock.close()


@contextmanager
def own_runtime_dir() -> Iterator[dict[str, str]]:
    """The environment for this module's commands; its engines are stopped on the way out."""
    root = Path(tempfile.mkdtemp(prefix="acl-", dir="/tmp"))  # short: a socket's path fits in 107 bytes
    try:
        yield {**os.environ, "ACCELAB_RUNTIME_DIR": str(root)}
    finally:
        for path in root.glob("accelab-*/**/*.sock"):
            pid = engine_pid(path)
            if pid is not None:
                os.kill(pid, signal.SIGTERM)
        shutil.rmtree(root, ignore_errors=True)
