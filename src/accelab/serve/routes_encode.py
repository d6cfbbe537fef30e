"""POST /v1/embeddings (OpenAI's shape) and /v1/classify (images -> top-k labels)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from accelab.serve import openai_format as fmt
from accelab.serve.dispatch import Submission, check_count, long_text, prepare
from accelab.serve.errors import MODEL_ROUTE_ERRORS, ApiError
from accelab.serve.schemas import ClassifyRequest, EmbeddingRequest
from accelab.serve.state import ServerState

router = APIRouter()


@router.post("/v1/embeddings", responses=MODEL_ROUTE_ERRORS)
async def embeddings(body: EmbeddingRequest, request: Request) -> JSONResponse:
    arrival = time.monotonic()
    state: ServerState = request.app.state.accelab
    engine = state.require("embeddings", body.model)
    try:
        inputs = body.inputs
    except ValueError as err:
        raise ApiError(422, str(err), param="input") from None
    check_count("inputs", len(inputs), state.config.max_inputs)
    where = "input" if len(inputs) == 1 else "input[{}]"
    units = await prepare(
        lambda: [
            engine.prepare_text(text, truncate=body.truncate, where=where.format(i)) for i, text in enumerate(inputs)
        ],
        offload=long_text(inputs),
    )
    submission = Submission(state, key="embed", units=units, run=engine.embed, arrival=arrival, scope=request.scope)
    outcome = await submission.result(request.receive)
    vectors: list[Any] = outcome.outputs
    if body.dimensions is not None and body.dimensions != len(vectors[0]):
        raise ApiError(
            422,
            f"dimensions={body.dimensions} is not supported: {state.config.model_name} gives "
            f"{len(vectors[0])}-dimensional embeddings; leave dimensions out",
            param="dimensions",
        )
    tokens = sum(unit.tokens for unit in units)
    state.metrics.prompt_tokens.inc(tokens)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    truncated = sum(unit.truncated for unit in units)
    if truncated:  # tokens left out of the embeddings, because the request asked to truncate
        usage["truncated_tokens"] = truncated
    # a Response skips FastAPI's jsonable_encoder, which walks every float (slow for 384 x N)
    return JSONResponse(
        {
            "object": "list",
            "data": [fmt.embedding_item(i, v, body.encoding_format) for i, v in enumerate(vectors)],
            "model": state.config.model_name,
            "usage": usage,
        }
    )


@router.post("/v1/classify", responses=MODEL_ROUTE_ERRORS)
async def classify(body: ClassifyRequest, request: Request) -> dict[str, Any]:
    arrival = time.monotonic()
    state: ServerState = request.app.state.accelab
    engine = state.require("classify", body.model)
    images = body.all_images
    check_count("images", len(images), state.config.max_inputs)
    units = await prepare(
        lambda: [engine.prepare_image(data, top_k=body.top_k, where=f"images[{i}]") for i, data in enumerate(images)],
        offload=True,
    )
    submission = Submission(
        state, key="classify", units=units, run=engine.classify, arrival=arrival, scope=request.scope
    )
    outcome = await submission.result(request.receive)
    data = [
        {"index": i, "labels": [{"label": lab.label, "score": lab.score} for lab in labels]}
        for i, labels in enumerate(outcome.outputs)
    ]
    return {"object": "list", "model": state.config.model_name, "data": data, "usage": {"images": len(images)}}
