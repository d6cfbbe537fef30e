"""Errors as HTTP answers, in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
Every refusal says what was wrong and what to do about it."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

# status -> (OpenAI error type, metrics error kind)
_KINDS = {
    400: ("invalid_request_error", "invalid"),
    401: ("authentication_error", "unauthorized"),
    404: ("not_found_error", "invalid"),
    413: ("invalid_request_error", "too_large"),
    422: ("invalid_request_error", "invalid"),
    429: ("rate_limit_error", "queue_full"),
    499: ("client_closed_request", "client_gone"),  # nginx's code: nobody reads this answer
    500: ("server_error", "model_error"),
    503: ("server_error", "not_ready"),
    504: ("timeout_error", "timeout"),
}


class ErrorDetail(BaseModel):
    message: str  # what was wrong and what to do about it
    type: str  # OpenAI's error type (invalid_request_error, rate_limit_error, ...)
    param: str | None = None  # the request field at fault, where one is
    code: str | None = None  # accelab's error kind (the `kind` label of accelab_errors_total)


class ErrorResponse(BaseModel):
    """Every error answer: {"error": {"message", "type", "param", "code"}} (OpenAI's shape)."""

    error: ErrorDetail


_WHY = {
    400: "The request cannot be served as sent (a field this model or engine does not take, a prompt too "
    "long for the context, a token id outside the vocabulary); the message says which and how to fix it.",
    401: "No or a wrong API key (servers started with --api-key).",
    404: "The model named is not the one this server serves.",
    413: "More inputs, images or tokens than this server takes in one request (--max-inputs, the KV cache).",
    422: "The body does not follow this schema; `param` names the field.",
    429: "The queue is full (--max-queue); retry after the Retry-After header's seconds.",
    500: "The model failed on this request (it fails alone: the others go on).",
    503: "The model is still loading, failed to load, or the server is draining.",
    504: "The request waited longer than its deadline (--request-timeout).",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for the errors a route answers, each with the ErrorResponse body."""
    return {status: {"model": ErrorResponse, "description": _WHY[status]} for status in statuses}


MODEL_ROUTE_ERRORS = error_responses(400, 401, 404, 413, 422, 429, 500, 503, 504)


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind or _KINDS.get(status, ("server_error", "model_error"))[1]
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.kind)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind = _KINDS.get(status, ("server_error", "model_error"))[0]
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def validation_message(err: RequestValidationError) -> tuple[str, str | None]:
    """'messages.0.role: Input should be 'system', ... (got 'robot')' for each problem."""
    problems, first = [], None
    for e in err.errors():
        loc = [str(p) for p in e.get("loc", ()) if p != "body"]
        # pydantic names union members in the location (e.g. "list[str]"); people want the field
        loc = [p for p in loc if not (p[:1].islower() and ("[" in p or p in ("str", "int", "function-after")))]
        where = ".".join(loc) or "body"
        first = first or where
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        got = e.get("input")
        shown = "" if isinstance(got, (dict, list)) or got is None or e.get("type") == "missing" else f" (got {got!r})"
        problems.append(f"{where}: {msg}{shown}")
    unique = list(dict.fromkeys(problems))
    return "invalid request: " + "; ".join(unique[:5]) + ("; ..." if len(unique) > 5 else ""), first


# Starlette hands a handler the exception it was registered for, typed as any Exception
async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError), "registered for ApiError"
    request.state.error_kind = exc.kind
    return exc.response()


async def validation_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError), "registered for RequestValidationError"
    message, param = validation_message(exc)
    request.state.error_kind = "invalid"
    return ApiError(422, message, param=param).response()


async def http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's and FastAPI's own errors (a body that is not JSON, an unknown path or method)
    in the same shape as every other error."""
    assert isinstance(exc, StarletteHTTPException), "registered for HTTPException"
    message = str(exc.detail)
    if message == "There was an error parsing the body":
        message = "the body is not valid JSON; send one JSON object (Content-Type: application/json)"
    error = ApiError(exc.status_code, message, headers=dict(exc.headers or {}))
    request.state.error_kind = error.kind
    return error.response()
