"""The server's OpenAPI schema documents what it answers: every error status a route returns,
with the body every error has, and the content types (JSON, server-sent events, Prometheus text),
so a client generated from /openapi.json handles the answers the server sends."""

from __future__ import annotations

import pytest

from accelab.serve.app import create_app
from accelab.serve.config import ServeConfig
from accelab.serve.errors import ApiError, ErrorResponse

MODEL_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/classify")
ERRORS = {"400", "401", "404", "413", "422", "429", "500", "503", "504"}


@pytest.fixture(scope="module")
def spec() -> dict:
    return create_app(ServeConfig(model_name="tiny"), lambda: None).openapi()  # no model: the schema only


@pytest.mark.parametrize("path", MODEL_ROUTES)
def test_model_routes_document_every_error_status_with_the_error_body(spec, path):
    responses = spec["paths"][path]["post"]["responses"]
    assert set(responses) == {"200"} | ERRORS
    for status in ERRORS:
        body = responses[status]["content"]["application/json"]["schema"]
        assert body == {"$ref": "#/components/schemas/ErrorResponse"}, status
        assert responses[status]["description"]  # what it means, for people


def test_generation_routes_document_their_event_streams_and_probes_their_503(spec):
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert set(spec["paths"][path]["post"]["responses"]["200"]["content"]) == {
            "application/json",
            "text/event-stream",
        }
    assert set(spec["paths"]["/v1/embeddings"]["post"]["responses"]["200"]["content"]) == {"application/json"}
    for path in ("/readyz", "/health", "/livez", "/v1/models", "/metrics"):
        assert {"200", "401", "503"} <= set(spec["paths"][path]["get"]["responses"]), path
    assert list(spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == [
        "text/plain; version=1.0.0; charset=utf-8"
    ]


@pytest.mark.parametrize("status", sorted(int(s) for s in ERRORS))
def test_every_error_the_server_sends_is_the_documented_body(spec, status):
    body = ApiError(status, "what was wrong, and what to do", param="field").body()
    parsed = ErrorResponse.model_validate(body)
    assert parsed.error.param == "field" and parsed.error.message.startswith("what was wrong")
    schema = spec["components"]["schemas"]["ErrorResponse"]
    assert schema["required"] == ["error"]
