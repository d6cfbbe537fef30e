"""POST /v1/chat/completions and /v1/completions: OpenAI-compatible, streaming (SSE) or not.

A request becomes units (`accelab.serve.request_rules`: one per prompt and choice, its limits
checked there, once), which the state's executor runs; this module shapes the answers (one JSON
body, or server-sent events) and maps a failure to its HTTP status.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from accelab.serve import openai_format as fmt, tools
from accelab.serve.dispatch import Submission, check_count, long_text, prepare
from accelab.serve.engines.base import Completion, GenUnit
from accelab.serve.engines.interfaces import GenerationEngine
from accelab.serve.errors import MODEL_ROUTE_ERRORS, ApiError
from accelab.serve.images import fetch_remote, is_url
from accelab.serve.jobs import JobOutcome
from accelab.serve.request_rules import chat_grammar, fit, make_units, refuse_unsupported, sampling_params
from accelab.serve.runner.logprobs import describe
from accelab.serve.schemas import ChatRequest, CompletionRequest, _Sampling
from accelab.serve.state import ServerState

log = logging.getLogger(__name__)

router = APIRouter()


# one server-sent event as OpenAPI tools read a stream: its `data` is a JSON chunk, a JSON error or "[DONE]"
SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}},
}
STREAMED: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The answer: one JSON object, or with `stream: true` server-sent events (`data: {chunk}` "
        'lines, then `data: [DONE]`; an error after the first event arrives as a `data: {"error": ...}` event).',
        "content": {"application/json": {}, "text/event-stream": {"schema": SSE_EVENT}},
    }
}


@router.post("/v1/chat/completions", responses={**STREAMED, **MODEL_ROUTE_ERRORS})
async def chat_completions(body: ChatRequest, request: Request) -> Any:
    arrival = time.monotonic()
    state: ServerState = request.app.state.accelab
    refuse_unsupported(body)
    engine = state.require_generation("chat", body.model)
    specs = tools.tool_specs(body.tools) if body.tools else None
    grammar = chat_grammar(body, specs)
    params = sampling_params(
        body, body.requested_tokens, state.config, engine, logprobs=body.logprob_count, grammar=grammar
    )
    messages = [m.to_engine() for m in body.messages]
    parts = [p for m in messages if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image"]
    images = len(parts)
    texts = [m["content"] if isinstance(m["content"], str) else "" for m in messages]
    started = time.monotonic()
    between_steps = state.image_preparer() if images else None
    if between_steps is not None and any(
        is_url(p["url"]) for p in parts
    ):  # the worker's thread never waits on the network
        policy = getattr(engine, "image_policy", None)
        messages = await prepare(lambda: fetch_remote(messages, policy), offload=True)
    chat = (lambda: engine.prepare_chat(messages, tools=specs)) if specs else (lambda: engine.prepare_chat(messages))
    prompt = await prepare(
        lambda: fit(engine, chat(), params, body.truncate),
        offload=bool(images) or long_text(texts) or bool(specs),
        between_steps=between_steps,
    )
    if images:
        state.metrics.request_images.observe(images)
        state.metrics.image_preprocess_time.observe(time.monotonic() - started)
    units = await make_units(engine, [prompt], params, body.n)
    env = fmt.Envelope(kind="chat", model=state.config.model_name, truncated=prompt.truncated, n=body.n)
    calls = specs is not None and body.tool_choice != "none"
    return await _generate(state, engine, units, body, env, arrival, request, tool_calls=calls)


@router.post("/v1/completions", responses={**STREAMED, **MODEL_ROUTE_ERRORS})
async def completions(body: CompletionRequest, request: Request) -> Any:
    arrival = time.monotonic()
    state: ServerState = request.app.state.accelab
    refuse_unsupported(body)
    engine = state.require_generation("completions", body.model)
    echo_logprobs = body.logprobs if body.echo else None
    params = sampling_params(
        body, body.requested_tokens, state.config, engine, logprobs=body.logprob_count, prompt_logprobs=echo_logprobs
    )
    texts = body.prompts
    check_count("prompts", len(texts) * body.n, state.config.max_inputs)
    prompts = await prepare(
        lambda: [fit(engine, engine.prepare_text(t), params, body.truncate) for t in texts], offload=long_text(texts)
    )
    units = await make_units(engine, prompts, params, body.n)
    env = fmt.Envelope(
        kind="completions", model=state.config.model_name, truncated=sum(p.truncated for p in prompts), n=body.n
    )
    echoes = None
    if body.echo:
        echoes = [
            t if isinstance(t, str) else engine.decode(list(p.ids))
            for t, p in zip(texts, prompts)
            for _ in range(body.n)
        ]
    return await _generate(state, engine, units, body, env, arrival, request, echoes=echoes)


# -- running and answering -----------------------------------------------------------------
@dataclasses.dataclass(kw_only=True, slots=True)
class _Answer:
    """What shapes the answer: echoed prompts, tool-call parsing, the decoder for logprobs."""

    env: fmt.Envelope
    decode: Any
    echoes: list[str] | None = None
    tool_calls: bool = False

    def choice(self, index: int, done: Completion) -> fmt.Choice:
        if self.echoes is not None:
            done = dataclasses.replace(done, prompt_text=self.echoes[index])
        if self.tool_calls:
            content, calls = tools.parse_calls(done.text)
            return fmt.Choice(completion=done, content=content, tool_calls=[c.to_openai() for c in calls])
        return fmt.Choice(completion=done, content=done.text, echo=self.echoes is not None)


async def _generate(
    state: ServerState,
    engine: GenerationEngine,
    units: list[GenUnit],
    body: _Sampling,
    env: fmt.Envelope,
    arrival: float,
    request: Request,
    *,
    echoes: list[str] | None = None,
    tool_calls: bool = False,
) -> Any:
    events: asyncio.Queue[tuple[int, str, int] | None] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    if body.stream:
        for i, unit in enumerate(units):
            unit.on_text = _pusher(loop, events, i, unit)
    answer = _Answer(env=env, decode=engine.decode, echoes=echoes, tool_calls=tool_calls)
    # one request's prompts share a key: chat has one prompt, completions' prompts are text only
    submission = Submission(
        state, key=units[0].prompt.batch_key, units=units, run=engine.generate, arrival=arrival, scope=request.scope
    )
    if not body.stream:
        try:
            outcome = await submission.result(request.receive)
        except ApiError as err:
            if err.kind == "client_gone":  # stop its rows: nobody will read them
                for unit in units:
                    unit.cancelled = True
            raise
        _observe(state, outcome, units, arrival)
        return JSONResponse(fmt.full_response(env, [answer.choice(i, c) for i, c in enumerate(outcome.outputs)]))
    try:
        await submission.wait_started()
    except BaseException:
        submission.abandon()
        raise
    submission.outcome.add_done_callback(lambda _: events.put_nowait(None))
    return StreamingResponse(
        _stream(state, submission, units, events, body, answer, arrival),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )


async def _stream(
    state: ServerState,
    submission: Submission,
    units: list[GenUnit],
    events: asyncio.Queue[tuple[int, str, int] | None],
    body: _Sampling,
    answer: _Answer,
    arrival: float,
) -> AsyncIterator[str]:
    env = answer.env
    finished = False
    streams = [_ChoiceStream(index=i, unit=u, answer=answer, body=body) for i, u in enumerate(units)]
    try:
        if env.kind == "chat":
            for s in streams:
                yield fmt.sse(fmt.chunk(env, s.index, role=True))
        while (event := await events.get()) is not None:
            index, text, sampled = event
            for chunk in streams[index].text(text, sampled):
                yield fmt.sse(chunk)
        try:
            outcome = await submission.result()
        except ApiError as err:  # the status line went out already: the error travels in the stream
            state.metrics.errors.labels(kind=err.kind).inc()
            yield fmt.sse(err.body())
        else:
            completions: list[Completion] = outcome.outputs
            _observe(state, outcome, units, arrival)
            for s, done in zip(streams, completions):
                for chunk in s.finish(done):
                    yield fmt.sse(chunk)
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


@dataclasses.dataclass(kw_only=True, slots=True)
class _ChoiceStream:
    """One choice's chunks: text with its tokens' logprobs, the echoed prompt first, tool calls
    (held back, then one delta) and usage in every chunk when continuous_usage_stats is set."""

    index: int
    unit: GenUnit
    answer: _Answer
    body: _Sampling
    sent_logprobs: int = 0
    echoed: bool = False
    calls: tools.CallFilter | None = None

    def __post_init__(self) -> None:
        if self.answer.tool_calls:
            self.calls = tools.CallFilter()

    def text(self, text: str, sampled: int) -> list[dict[str, Any]]:
        out = self._echo()
        entries = None
        if self.unit.params.logprobs is not None:
            entries = describe(self.unit.sampled[self.sent_logprobs : sampled], self.answer.decode)
            self.sent_logprobs = max(self.sent_logprobs, sampled)
        piece = self.calls.push(text) if self.calls is not None else text
        if piece or entries:
            out.append(fmt.chunk(self.answer.env, self.index, piece, logprobs=entries, usage_=self._usage()))
        return out

    def finish(self, done: Completion) -> list[dict[str, Any]]:
        env, out = self.answer.env, self._echo()
        entries = None
        if done.logprobs is not None and len(done.logprobs) > self.sent_logprobs:
            entries = done.logprobs[self.sent_logprobs :]
        choice = self.answer.choice(self.index, done)
        rest = None
        if self.calls is not None and not choice.tool_calls and self.calls.sent < len(self.calls.text):
            rest = self.calls.text[self.calls.sent :]  # held back as a possible call; it was not one
        if entries or rest or choice.tool_calls:
            out.append(
                fmt.chunk(
                    env,
                    self.index,
                    rest,
                    logprobs=entries,
                    tool_calls=[{**c, "index": i} for i, c in enumerate(choice.tool_calls)] or None,
                )
            )
        out.append(fmt.chunk(env, self.index, finish_reason=choice.finish_reason, usage_=fmt.usage([done])))
        return out

    def _echo(self) -> list[dict[str, Any]]:
        if self.answer.echoes is None or self.echoed:
            return []
        self.echoed = True
        entries = None
        if self.unit.prompt_sampled is not None:
            entries = describe(self.unit.prompt_sampled, self.answer.decode)
        return [fmt.chunk(self.answer.env, self.index, self.answer.echoes[self.index], logprobs=entries)]

    def _usage(self) -> dict[str, int] | None:
        if not self.body.continuous_usage:
            return None
        prompt, generated = self.unit.prompt.prompt_tokens, self.unit.tokens
        return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


def _observe(state: ServerState, outcome: JobOutcome, units: list[GenUnit], arrival: float) -> None:
    state.metrics.observe_generation(
        outcome.outputs, arrival=arrival, queue_s=outcome.queue_s, max_tokens=units[0].params.max_tokens
    )


def _pusher(loop: asyncio.AbstractEventLoop, events: asyncio.Queue, index: int, unit: GenUnit):
    def push(text: str) -> None:  # called in the worker thread, right after the token that made `text`
        sampled = len(unit.sampled)  # the logprobs of the tokens behind this text
        try:
            loop.call_soon_threadsafe(events.put_nowait, (index, text, sampled))
        except RuntimeError:  # loop closed
            pass

    return push
