"""accelab's side of an engine process's socket (vLLM's, OpenVINO GenAI's): submit token ids, get
each request's tokens back.

One reader thread per connection reads the engine's messages and calls each request's handler
(in that thread: handlers must be quick and thread-safe); writes from any thread go through one
lock. When the engine goes away every pending request gets a Failed message, so no caller waits
forever.
"""

from __future__ import annotations

import itertools
import logging
import queue
import socket
import threading
from collections.abc import Callable
from typing import Any

from accelab.backends import engine_wire as W

log = logging.getLogger(__name__)

Handler = Callable[[Any], None]  # receives Tokens, Scored or Failed


class EngineGone(RuntimeError):
    pass


class EngineClient:
    def __init__(self, sock: socket.socket, *, name: str = "engine"):
        self._sock = sock
        self._file = sock.makefile("rb")
        self._write_lock = threading.Lock()
        self._handlers: dict[str, Handler] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._on_stats: Callable[[Any], None] | None = None
        self.name = name
        self.closed = False
        first = self._file.readline()
        if not first:
            raise EngineGone(f"the {name} closed the connection before saying what it runs")
        self.info: W.Info = W.decode(first)
        self._reader = threading.Thread(target=self._read, name="accelab-engine-reader", daemon=True)
        self._reader.start()

    # -- sending -----------------------------------------------------------------------------------
    def new_id(self) -> str:
        return str(next(self._ids))

    def submit(self, message: W.Submit | W.Score, handler: Handler) -> None:
        with self._lock:
            if self.closed:
                raise EngineGone(f"the {self.name} is gone")
            self._handlers[message.id] = handler
        self._send(message)

    def abort(self, request_id: str) -> None:
        with self._lock:
            if request_id not in self._handlers:
                return
        self._send(W.Abort(id=request_id))

    def watch(self, on_stats: Callable[[Any], None]) -> None:
        self._on_stats = on_stats
        self._send(W.Watch())

    def _send(self, message: Any) -> None:
        data = W.encode(message)
        try:
            with self._write_lock:
                self._sock.sendall(data)
        except OSError as err:
            raise EngineGone(f"the {self.name} is gone ({err})") from None

    # -- blocking helpers ------------------------------------------------------------------------
    def score(self, prompt_ids: list[int], timeout_s: float = 600) -> list[float]:
        """log p(token i | tokens < i) for i >= 1, computed by the engine."""
        return self.score_top(prompt_ids, 0, timeout_s).logprobs

    def score_top(self, prompt_ids: list[int], top_k: int, timeout_s: float = 600) -> W.Scored:
        """The engine's Scored answer: the log-probabilities of the prompt's tokens, and its top_k
        ids and log-probabilities at each of those positions."""
        box: queue.Queue = queue.Queue()
        self.submit(W.Score(id=self.new_id(), prompt_ids=prompt_ids, top_k=top_k), box.put)
        answer = box.get(timeout=timeout_s)
        if isinstance(answer, W.Failed):
            raise RuntimeError(f"the {self.name} could not score the text: {answer.error}")
        return answer

    # -- the reader thread ------------------------------------------------------------------------
    def _read(self) -> None:
        try:
            for line in self._file:
                message = W.decode(line)
                if isinstance(message, W.Stats):
                    if self._on_stats is not None:
                        _safely(self._on_stats, message)
                    continue
                done = isinstance(message, (W.Scored, W.Failed)) or getattr(message, "finished", None) is not None
                with self._lock:
                    handler = self._handlers.pop(message.id, None) if done else self._handlers.get(message.id)
                if handler is not None:
                    _safely(handler, message)
                elif isinstance(message, W.Failed) and not message.id:
                    log.error("the %s refused a message: %s", self.name, message.error)
        except (OSError, ValueError) as err:
            if not self.closed:
                log.warning("reading from the %s failed: %r", self.name, err)
        finally:
            self._fail_all(
                f"the {self.name} process went away (its log is in accelab's runtime directory for it, under /tmp)"
            )

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            self.closed = True
            pending, self._handlers = self._handlers, {}
        for request_id, handler in pending.items():
            _safely(handler, W.Failed(id=request_id, error=reason))

    @property
    def alive(self) -> bool:
        return self._reader.is_alive()

    def close(self) -> None:
        if self.closed and not self._reader.is_alive():
            return
        self.closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._reader.join(timeout=5)


def _safely(callback: Callable[[Any], None], message: Any) -> None:
    try:
        callback(message)
    except Exception:  # a broken handler must not stop the reader
        log.exception("an engine message handler failed")
