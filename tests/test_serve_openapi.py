"""The server's OpenAPI schema documents what it answers: every error status a route returns,
with the body every error has, and the content types (JSON, server-sent events, Prometheus text),
so a client generated from /openapi.json handles the answers the server sends."""

from __future__ import annotations

import jsonschema
import pytest

from accelab.serve import openai_format as fmt
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


def test_each_event_of_a_stream_is_what_the_event_stream_schema_documents(spec):
    """OpenAPI tools (schemathesis, generated clients) read text/event-stream as one object per event
    ({"data": ..., "event": ...}) and check each against the documented schema; a schema of
    `string` failed every streamed answer."""
    env = fmt.Envelope(kind="completion", model="tiny", truncated=0, n=1)
    stream = fmt.sse(fmt.chunk(env, 0, text="hi")) + fmt.sse({"error": {"message": "m"}}) + fmt.sse("[DONE]")
    events = [{"event": "message", "data": block.removeprefix("data: ")} for block in stream.split("\n\n") if block]
    assert len(events) == 3
    for path in ("/v1/chat/completions", "/v1/completions"):
        schema = spec["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
        for event in events:
            jsonschema.validate(event, schema)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"event": "message"}, schema)  # an event without data


@pytest.mark.parametrize("status", sorted(int(s) for s in ERRORS))
def test_every_error_the_server_sends_is_the_documented_body(spec, status):
    body = ApiError(status, "what was wrong, and what to do", param="field").body()
    parsed = ErrorResponse.model_validate(body)
    assert parsed.error.param == "field" and parsed.error.message.startswith("what was wrong")
    schema = spec["components"]["schemas"]["ErrorResponse"]
    assert schema["required"] == ["error"]
