"""Log-probabilities for a response: a prompt's, scored in one forward (completions' echo), and
sampled tokens as the text the OpenAI fields carry (`describe`). The sampled tokens' own come
from `runner.sampling` (step 1 of its contract)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import overload

import torch

from accelab.serve.engines.base import TokenLogprob
from accelab.serve.runner.sampling import SampledToken


def prompt_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[SampledToken | None]:
    """logits: [L, V] of every prompt position -> per prompt token its log-probability given
    the tokens before it (the first has none: logprob None) and the `top` alternatives."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [L, V]
    out: list[SampledToken | None] = [SampledToken(token=tokens[0])]  # no logprob: nothing comes before it
    ids = torch.tensor(tokens[1:], dtype=torch.long)
    if not len(ids):
        return out
    chosen = logprobs[:-1].gather(1, ids[:, None])[:, 0].tolist()
    best = logprobs[:-1].topk(top, dim=-1) if top else None
    for i, (token, value) in enumerate(zip(ids.tolist(), chosen)):
        alternatives = () if best is None else tuple(zip(best.indices[i].tolist(), best.values[i].tolist()))
        out.append(SampledToken(token=token, logprob=value, top=alternatives))
    return out


@overload
def describe(tokens: Sequence[SampledToken], decode: Callable[[list[int]], str]) -> tuple[TokenLogprob, ...]: ...


@overload  # a prompt's: its first token has none (nothing before it to predict it)
def describe(
    tokens: Sequence[SampledToken | None], decode: Callable[[list[int]], str]
) -> tuple[TokenLogprob | None, ...]: ...


def describe(
    tokens: Sequence[SampledToken | None], decode: Callable[[list[int]], str]
) -> tuple[TokenLogprob | None, ...]:
    """SampledTokens as text for the response (each token and alternative decoded alone)."""
    cache: dict[int, str] = {}

    def text(token: int) -> str:
        if token not in cache:
            cache[token] = decode([token])
        return cache[token]

    return tuple(
        None
        if t is None
        else TokenLogprob(token=text(t.token), logprob=t.logprob, top=tuple((text(a), v) for a, v in t.top))
        for t in tokens
    )
