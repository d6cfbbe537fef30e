"""POST /v1/chat/completions and /v1/completions: OpenAI-compatible, streaming (SSE) or not."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from accelab.serve import openai_format as fmt
from accelab.serve.dispatch import Submission, check_count, long_text, prepare
from accelab.serve.engines.base import Completion, GenUnit, Prompt, SamplingParams
from accelab.serve.errors import ApiError
from accelab.serve.schemas import ChatRequest, CompletionRequest, _Sampling
from accelab.serve.state import ServerState

log = logging.getLogger(__name__)

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request) -> Any:
    arrival = time.monotonic()
    state: ServerState = request.app.state.accelab
    engine = state.require("chat", body.model)
    params = _params(body, body.requested_tokens, state)
    messages = [m.to_engine() for m in body.messages]
    has_images = any(isinstance(m["content"], list) and any(p["type"] == "image" for p in m["content"])
                     for m in messages)
    texts = [m["content"] if isinstance(m["content"], str) else "" for m in messages]
    prompt = await prepare(lambda: _fit(engine, engine.prepare_chat(messages), params, body.truncate),
                           offload=has_images or long_text(texts))
    env = fmt.Envelope(kind="chat", model=state.config.model_name, truncated=prompt.truncated)
    return await _generate(state, engine, [prompt], params, body, env, arrival, request)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Any:
    arrival = time.monotonic()
    state: ServerState = request.app.state.accelab
    engine = state.require("completions", body.model)
    params = _params(body, body.requested_tokens, state)
    texts = body.prompts
    check_count("prompts", len(texts), state.config.max_inputs)
    prompts = await prepare(lambda: [_fit(engine, engine.prepare_text(t), params, body.truncate) for t in texts],
                            offload=long_text(texts))
    env = fmt.Envelope(kind="completions", model=state.config.model_name, truncated=sum(p.truncated for p in prompts))
    return await _generate(state, engine, prompts, params, body, env, arrival, request)


def _params(body: _Sampling, requested: int | None, state: ServerState) -> SamplingParams:
    limit = state.config.max_tokens
    if requested is not None and requested > limit:
        raise ApiError(413, f"max_tokens={requested} is more than this server allows ({limit}, --max-tokens); "
                       f"ask for {limit} or fewer", param="max_tokens")
    default = min(state.config.default_max_tokens, limit)
    return SamplingParams(max_tokens=requested or default, temperature=body.temperature,
                          top_p=body.top_p, stop=body.stop_list, seed=body.seed)


def _fit(engine: Any, prompt: Prompt, params: SamplingParams, truncate: bool) -> Prompt:
    fit = getattr(engine, "fit", None)
    return prompt if fit is None else fit(prompt, params.max_tokens, truncate=truncate)


async def _generate(state: ServerState, engine: Any, prompts: list[Prompt], params: SamplingParams,
                    body: _Sampling, env: fmt.Envelope, arrival: float, request: Request) -> Any:
    events: asyncio.Queue[tuple[int, str] | None] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    units = [GenUnit(prompt=p, params=params, on_text=_pusher(loop, events, i) if body.stream else _ignore)
             for i, p in enumerate(prompts)]
    # one request's prompts share a key: chat has one prompt, completions' prompts are text only
    submission = Submission(state, key=prompts[0].batch_key, units=units, run=engine.generate, arrival=arrival,
                            scope=request.scope)
    if not body.stream:
        try:
            outcome = await submission.result(request.receive)
        except ApiError as err:
            if err.kind == "client_gone":  # stop its rows: nobody will read them
                for unit in units:
                    unit.cancelled = True
            raise
        _observe(state, outcome.outputs, arrival)
        return JSONResponse(fmt.full_response(env, outcome.outputs))
    try:
        await submission.wait_started()
    except BaseException:
        submission.abandon()
        raise
    submission.outcome.add_done_callback(lambda _: events.put_nowait(None))
    return StreamingResponse(_stream(state, submission, units, events, body, env, arrival),
                             media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _stream(state: ServerState, submission: Submission, units: list[GenUnit],
                  events: asyncio.Queue[tuple[int, str] | None], body: _Sampling, env: fmt.Envelope,
                  arrival: float) -> AsyncIterator[str]:
    finished = False
    try:
        if env.kind == "chat":
            yield fmt.sse(fmt.chunk(env, 0, role=True))
        while (event := await events.get()) is not None:
            index, text = event
            yield fmt.sse(fmt.chunk(env, index, text))
        try:
            outcome = await submission.result()
        except ApiError as err:  # the status line went out already: the error travels in the stream
            state.metrics.errors.labels(kind=err.kind).inc()
            yield fmt.sse(err.body())
        else:
            completions: list[Completion] = outcome.outputs
            _observe(state, completions, arrival)
            for index, done in enumerate(completions):
                yield fmt.sse(fmt.chunk(env, index, finish_reason=done.finish_reason, usage_=fmt.usage([done])))
            if body.include_usage:
                yield fmt.sse(fmt.usage_chunk(env, completions))
        yield fmt.sse("[DONE]")
        finished = True
    finally:
        if not finished:  # the client went away: stop its rows, drop it if still queued
            for unit in units:
                unit.cancelled = True
            submission.abandon()
            state.metrics.errors.labels(kind="client_gone").inc()


def _observe(state: ServerState, completions: list[Completion], arrival: float) -> None:
    m = state.metrics
    for done in completions:
        m.prompt_tokens.inc(done.prompt_tokens)
        m.generated_tokens.inc(done.completion_tokens)
        if done.first_token_at is not None:
            m.ttft.observe(done.first_token_at - arrival)
            if done.completion_tokens > 1:
                m.tpot.observe((done.finished_at - done.first_token_at) / (done.completion_tokens - 1))


def _pusher(loop: asyncio.AbstractEventLoop, events: asyncio.Queue, index: int):
    def push(text: str) -> None:  # called in the worker thread
        try:
            loop.call_soon_threadsafe(events.put_nowait, (index, text))
        except RuntimeError:  # loop closed
            pass

    return push


def _ignore(text: str) -> None:
    pass
