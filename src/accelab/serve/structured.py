"""Grammar-constrained decoding with llguidance (the library vLLM and SGLang use for it): a
JSON schema, "any JSON object" or a tool-call grammar becomes an llguidance grammar once per
request (`json_grammar`, `tools.tool_grammar`), and each sequence gets its own `Matcher`, whose
mask the sampler applies to that sequence's logits row (see `runner.sampling`).

Why llguidance: it has no dependencies (xgrammar pulls triton, outlines-core needs its own
vocabulary index build per schema), computes a mask in well under a millisecond for SmolLM2's
49k tokens, and takes JSON schemas and Lark grammars (with JSON schemas inside) alike. The
same masks serve the llama.cpp engines: their vocabulary is the Hugging Face tokenizer's.

JSON is compiled without free whitespace (`whitespace_flexible: false`): a small model left
free to indent may emit spaces and newlines until max_tokens.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # the TypedDict of llguidance's stub

log = logging.getLogger(__name__)

JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}

_tokenizers: dict[int, Any] = {}
_lock = threading.Lock()


class GrammarError(ValueError):
    """A schema or grammar the matcher cannot take: the request gets 400 with its message."""


def llg_tokenizer(tokenizer: Any, eos_id: int | None = None) -> Any:
    """The llguidance view of a Hugging Face fast tokenizer, built once per tokenizer (~0.6 s)."""
    import llguidance.hf

    with _lock:
        cached = _tokenizers.get(id(tokenizer))
        if cached is None:
            cached = _tokenizers[id(tokenizer)] = (tokenizer, llguidance.hf.from_tokenizer(tokenizer, eos_token=eos_id))
    return cached[1]


def json_grammar(schema: dict[str, Any] | None) -> str:
    """The grammar for JSON that validates against `schema` (None: any JSON object)."""
    from llguidance import LLMatcher

    try:
        return LLMatcher.grammar_from_json_schema(
            schema if schema is not None else {"type": "object"}, defaults=JSON_OPTIONS
        )
    except ValueError as err:
        raise GrammarError(f"the JSON schema cannot be used: {err}") from None


def lark_grammar(lark: str) -> str:
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_lark(lark)


def json_in_lark(schema: dict[str, Any]) -> str:
    """A JSON schema as a Lark rule body (`%json {...}`), compact like `json_grammar`."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS})


class Matcher:
    """One sequence's position in a grammar: which tokens may come next, and the token taken."""

    def __init__(self, tokenizer: Any, grammar: str, *, where: str = "response_format"):
        from llguidance import LLMatcher

        self._matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise GrammarError(f"{where}: {self._matcher.get_error()}")
        self._vocab = tokenizer.vocab_size

    def allowed(self, vocab: int) -> torch.Tensor:
        """[vocab] bool: the tokens the grammar allows next (ids past the tokenizer's: never)."""
        bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        mask = torch.zeros(vocab, dtype=torch.bool)
        n = min(vocab, self._vocab, bits.shape[0])
        mask[:n] = torch.from_numpy(bits[:n].astype(bool))
        return mask

    def consume_token(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            log.warning("the grammar refused token %d: %s", token, self._matcher.get_error())

    @property
    def done(self) -> bool:
        return self._matcher.is_stopped() or self._matcher.is_accepting()


def check_grammar(tokenizer: Any, grammar: str, *, where: str) -> None:
    """GrammarError (the request's 400) unless the grammar compiles."""
    Matcher(tokenizer, grammar, where=where)
