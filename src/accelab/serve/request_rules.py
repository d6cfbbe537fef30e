"""What a generation request asks, as the engine takes it: the request's limits checked once,
here, where it is parsed, then its units.

- Fields the server does not honour are refused by name (400) before anything runs.
- max_tokens against the server's `--max-tokens` (413), min_tokens against max_tokens, and the
  token ids of logit_bias and stop_token_ids against the model's vocabulary (400); the rest of
  the pipeline (scheduler, text stream, engines) takes the resulting `SamplingParams` as valid.
- response_format and tools become an llguidance grammar; a grammar that does not compile is a 400.
- A request becomes units: one per prompt and choice (`n` per prompt; choices after the first may
  share the first's prefilled KV), each with its own sampler where the engine samples per
  sequence (its rules, seed + choice index and, for structured outputs and tools, its own grammar
  matcher).
"""

from __future__ import annotations

from typing import Any

from accelab.serve import structured, tools
from accelab.serve.config import ServeConfig
from accelab.serve.dispatch import prepare
from accelab.serve.engines.base import GenUnit, Prompt, SamplingParams
from accelab.serve.engines.interfaces import GenerationEngine, SamplesPerSequence
from accelab.serve.errors import ApiError
from accelab.serve.schemas import ChatRequest, _Sampling, unsupported_fields

__all__ = ["chat_grammar", "fit", "make_units", "refuse_unsupported", "sampling_params"]


def refuse_unsupported(body: _Sampling) -> None:
    refused = unsupported_fields(body)
    if refused:
        name, advice = refused[0]
        others = f" (also: {', '.join(n for n, _ in refused[1:])})" if len(refused) > 1 else ""
        raise ApiError(400, f"field {name!r} is not supported by this server{others}: {advice}", param=name)


def sampling_params(
    body: _Sampling,
    requested: int | None,
    config: ServeConfig,
    engine: GenerationEngine,
    *,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    grammar: str | None = None,
) -> SamplingParams:
    """The request's rules, once its limits are checked."""
    max_tokens = _max_tokens(body, requested, config)
    _check_token_ids(body, engine.vocab_size)
    per_sequence = grammar is not None or body.min_tokens or body.ignore_eos or logprobs is not None
    if per_sequence and not isinstance(engine, SamplesPerSequence):
        raise ApiError(
            400,
            f"{config.model_name}'s engine does not take per-sequence sampling rules",
            param="response_format" if grammar else None,
        )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        stop=body.stop_list,
        seed=body.seed,
        top_k=max(body.top_k, 0),
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias=body.bias_pairs,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        min_tokens=body.min_tokens,
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        grammar=grammar,
    )


def _max_tokens(body: _Sampling, requested: int | None, config: ServeConfig) -> int:
    limit = config.max_tokens
    if requested is not None and requested > limit:
        raise ApiError(
            413,
            f"max_tokens={requested} is more than this server allows ({limit}, --max-tokens); ask for {limit} or fewer",
            param="max_tokens",
        )
    max_tokens = requested or min(config.default_max_tokens, limit)
    if body.min_tokens > max_tokens:
        raise ApiError(
            400,
            f"min_tokens={body.min_tokens} is more than max_tokens={max_tokens}; lower min_tokens",
            param="min_tokens",
        )
    return max_tokens


def _check_token_ids(body: _Sampling, vocab: int | None) -> None:
    for name, ids in (("logit_bias", [t for t, _ in body.bias_pairs]), ("stop_token_ids", body.stop_token_ids or [])):
        bad = next((t for t in ids if t < 0 or (vocab is not None and t >= vocab)), None)
        if bad is not None:
            raise ApiError(
                400,
                f"{name} names token {bad}, which is not in the vocabulary"
                + (f" (ids 0 to {vocab - 1})" if vocab else "")
                + "; send ids from this model's tokenizer",
                param=name,
            )


def chat_grammar(body: ChatRequest, specs: list[dict[str, Any]] | None) -> str | None:
    """The llguidance grammar the answer must follow (response_format, tools), or None."""
    fmt_ = body.response_format
    schema = None
    if fmt_ is not None and fmt_.type == "json_object":
        schema = {"type": "object"}
    elif fmt_ is not None and fmt_.type == "json_schema" and fmt_.json_schema is not None:  # (its validator)
        schema = fmt_.json_schema.schema_
    try:
        if specs:
            choice = body.tool_choice
            named = getattr(getattr(choice, "function", None), "name", None)
            return tools.tool_grammar(specs, named or choice or "auto", text_schema=schema)
        return None if schema is None else structured.json_grammar(schema)
    except structured.GrammarError as err:
        raise ApiError(400, str(err), param="tools" if specs else "response_format") from None


async def make_units(engine: GenerationEngine, prompts: list[Prompt], params: SamplingParams, n: int) -> list[GenUnit]:
    """n units per prompt; choice i samples from seed + i and may share choice 0's prefill."""

    def build() -> list[GenUnit]:
        units = []
        for prompt in prompts:
            first = None
            for i in range(n):
                unit = GenUnit(prompt=prompt, params=params, fork_of=first)
                unit.sampler = _sampler(engine, params, prompt, i)
                first = first or unit
                units.append(unit)
        return units

    try:
        return await prepare(build, offload=params.grammar is not None)
    except ApiError as err:
        if err.status == 422 and params.grammar is not None:  # the grammar did not compile
            raise ApiError(400, err.message, param="response_format") from None
        raise


def _sampler(engine: GenerationEngine, params: SamplingParams, prompt: Prompt, index: int) -> Any:
    if not isinstance(engine, SamplesPerSequence):
        return None
    grammar = None
    if params.grammar is not None:
        grammar = structured.Matcher(engine.grammar_tokenizer(), params.grammar)
    return engine.sampler(params, prompt, grammar=grammar, seed_offset=index)


def fit(engine: GenerationEngine, prompt: Prompt, params: SamplingParams, truncate: bool) -> Prompt:
    """The prompt, checked (or, with `truncate`, cut) against the model's context with max_tokens."""
    return engine.fit(prompt, params.max_tokens, truncate=truncate)
