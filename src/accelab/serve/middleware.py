"""The guard in front of the API routes (plain ASGI, so streaming responses pass untouched):
counts requests in flight (SIGTERM waits for them), checks the API key (401), refuses new
work while draining (503), caps the body size (413), and records per-route metrics.

/livez, /readyz and /metrics pass without key, so probes and scrapers need no secret.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from accelab.serve.errors import ApiError
from accelab.serve.state import ServerState

OPEN_PATHS = frozenset({"/livez", "/readyz", "/metrics"})
ROUTE_LABELS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/classify": "classify",
    "/v1/models": "models",
}

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class GuardMiddleware:
    def __init__(self, app: Callable[..., Awaitable[None]], state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        route = ROUTE_LABELS.get(scope["path"], "other")
        status = [500]

        async def send_recording(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        started = time.perf_counter()
        self.state.enter()
        self.state.arrive(scope)
        try:
            refusal = self._refusal(scope)
            if refusal is None:
                body = await self._read_body(scope, receive)
                if isinstance(body, ApiError):
                    refusal = body
                else:
                    await self.app(scope, _replay(body, receive), send_recording)
            if refusal is not None:
                scope.setdefault("state", {})["error_kind"] = refusal.kind
                await _send_error(refusal, send_recording)
        finally:
            self.state.submitted(scope)  # if it never reached a queue
            self.state.leave()
            self._record(scope, route, status[0], time.perf_counter() - started)

    def _refusal(self, scope: Scope) -> ApiError | None:
        key = self.state.config.api_key
        if key is not None:
            given = _header(scope, b"authorization")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                what = "no Authorization header" if not given else "a wrong API key"
                return ApiError(
                    401,
                    f"this server needs an API key: the request had {what}; send "
                    "'Authorization: Bearer <key>' (the key given by --api-key or ACCELAB_API_KEY)",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        if self.state.status == "draining":
            return ApiError(
                503,
                "the server is shutting down; send the request to another replica",
                kind="shutting_down",
                headers={"Retry-After": "1", "Connection": "close"},
            )
        return None

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | ApiError:
        limit = self.state.config.max_body_bytes
        too_large = ApiError(
            413,
            f"the request body is larger than {limit:,} bytes (--max-body-bytes); send "
            "fewer or smaller inputs per request",
        )
        declared = _header(scope, b"content-length")
        if declared.isdecimal() and int(declared) > limit:
            return too_large
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)

    def _record(self, scope: Scope, route: str, status: int, seconds: float) -> None:
        m = self.state.metrics
        m.requests.labels(route=route, status=str(status)).inc()
        m.latency.labels(route=route).observe(seconds)
        if status >= 400:
            kind = scope.get("state", {}).get("error_kind") or ("invalid" if status < 500 else "model_error")
            m.errors.labels(kind=kind).inc()


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return ""


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body, read once already, then the real channel (a stream needs its disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _send_error(err: ApiError, send: Send) -> None:
    payload = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
