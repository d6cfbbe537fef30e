"""The FastAPI app: routes, the guard middleware, error handlers and the lifespan (worker
start, background model load; worker stop on shutdown).

`engine_factory` builds the engine (load + apply the plan) in a background thread, so tests
inject fakes and the CLI a real model; see `accelab.serve.server.engine_factory`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from accelab.serve.config import ServeConfig
from accelab.serve.engines.base import ROUTES_OF_TASK
from accelab.serve.engines.interfaces import Engine
from accelab.serve.errors import (
    ApiError,
    api_error_handler,
    error_responses,
    http_error_handler,
    validation_error_handler,
)
from accelab.serve.metrics import CONTENT_TYPE_LATEST, ServeMetrics
from accelab.serve.middleware import GuardMiddleware
from accelab.serve.routes_encode import router as encode_router
from accelab.serve.routes_generate import router as generate_router
from accelab.serve.state import ServerState


def create_app(
    config: ServeConfig,
    engine_factory: Callable[[], Engine],
    *,
    metrics: ServeMetrics | None = None,
    stop_timeout_s: float = 5.0,
) -> FastAPI:
    metrics = metrics or ServeMetrics()
    metrics.configure(max_queue=config.max_queue, model_name=config.model_name, aliases=config.metric_aliases)
    state = ServerState(config, engine_factory, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.start()
        try:
            yield
        finally:
            state.stop(timeout_s=stop_timeout_s)

    app = FastAPI(title=f"accelab serve {config.model_name}", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.accelab = state
    app.add_middleware(GuardMiddleware, state=state)
    app.add_exception_handler(ApiError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.include_router(generate_router)
    app.include_router(encode_router)
    _add_probes(app, state)
    return app


# what the middleware may answer on any route: a missing API key, and draining (SIGTERM)
_ANY_ROUTE = error_responses(401, 503)
_READY = {
    **_ANY_ROUTE,
    503: {
        "description": "Not ready: the model is loading, failed to load (`error` says why), or the server drains.",
        "content": {"application/json": {}},
    },
}


def _add_probes(app: FastAPI, state: ServerState) -> None:
    @app.get("/livez", responses=_ANY_ROUTE)
    async def livez() -> dict:
        return {"status": "alive"}

    @app.get("/readyz", responses=_READY)
    async def readyz() -> JSONResponse:
        body: dict[str, Any] = {"status": state.status, "model": state.config.model_name}
        if state.load_error:
            body["error"] = state.load_error
        if state.kv_cache is not None:
            body["kv_cache"] = state.kv_cache  # its capacity, in tokens and bytes
        # processes outside this one that run the model (vLLM's engine), for whoever counts its memory
        workers = getattr(getattr(state.engine, "runnable", None), "worker_pids", ())
        if workers:
            body["worker_pids"] = list(workers)
        return JSONResponse(body, status_code=200 if state.status == "ready" else 503)

    app.add_api_route("/health", readyz, methods=["GET"], responses=_READY)  # the name vLLM uses; guidellm probes it

    @app.get(
        "/metrics",
        response_class=Response,
        responses={**_ANY_ROUTE, 200: {"description": "Prometheus text format", "content": {CONTENT_TYPE_LATEST: {}}}},
    )
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses=_ANY_ROUTE)
    async def models(request: Request) -> dict:
        engine = state.engine
        entry = {
            "id": state.config.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "accelab",
            "plan": state.config.plan_name,
        }
        if engine is not None:
            entry["task"] = engine.task
            entry["routes"] = sorted(ROUTES_OF_TASK[engine.task])
        return {"object": "list", "data": [entry]}
