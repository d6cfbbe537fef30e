"""A sequence's tokens to its client, the same way whichever worker made them (the continuous
worker's steps, an engine process's stream, the rows of a per-batch `generate`): `deliver` hands
one token on (counted, through the sequence's TextStream for its text and stop strings, its
log-probability kept where asked, the new text emitted), `completion` answers the finished one."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from accelab.serve.engines.base import Completion, GenUnit
from accelab.serve.runner.logprobs import describe
from accelab.serve.runner.sampling import SampledToken
from accelab.serve.stops import FinishReason
from accelab.serve.textstream import Step, TextStream


def deliver(
    unit: GenUnit,
    stream: TextStream,
    token: int,
    *,
    ends: FinishReason | None,
    now: float,
    sampled: SampledToken | None = None,
) -> Step:
    """`token`, the next of `unit`'s sequence, with the verdict on it (`ends`: its StopRules'); the
    step says the text sent and whether the sequence finished (`ends`, or a stop string in its text).
    `sampled`: the token with its log-probabilities, kept when the request asked for them (an end or
    stop token is no text: not kept)."""
    unit.note_token(now)
    piece = stream.push(token, ends=ends)
    if unit.params.logprobs is not None and sampled is not None and not stream.ended_on_stop_token:
        unit.sampled.append(sampled)
    unit.emit(piece.text)
    return piece


def completion(
    unit: GenUnit,
    stream: TextStream,
    *,
    finished_at: float,
    decode: Callable[[Sequence[int]], str],
    finish_reason: FinishReason | None = None,
) -> Completion:
    """The answer of `unit`'s finished sequence: its text, why it ended (the stream's reason unless
    given; "length" when neither says), its token counts and log-probabilities where asked."""
    echo = unit.prompt_sampled
    return Completion(
        text=stream.output,
        finish_reason=finish_reason or stream.finish_reason or "length",
        prompt_tokens=unit.prompt.prompt_tokens,
        completion_tokens=stream.tokens,
        first_token_at=unit.first_token_at,
        finished_at=finished_at,
        logprobs=None if unit.params.logprobs is None else describe(unit.sampled, decode),
        prompt_logprobs=None if echo is None else describe(echo, decode),
    )
