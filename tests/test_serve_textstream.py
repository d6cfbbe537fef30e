"""Incremental detokenisation with stop strings (a fake decoder), and the token-level stops
(max_tokens, EOS, stop token ids, min_tokens) that StopRules decides and the stream is told."""

from __future__ import annotations

import pytest

from accelab.serve.engines.base import SamplingParams
from accelab.serve.stops import StopRules
from accelab.serve.textstream import TextStream

VOCAB = {0: "Hello", 1: ",", 2: " world", 3: ".", 4: " The", 5: " end", 6: "</s>", 7: " ST", 8: "OP", 9: " more"}


def decode(ids) -> str:
    return "".join(VOCAB[i] for i in ids if i != 6)


PLAIN = StopRules(max_tokens=10)


def run(stream: TextStream, tokens: list[int], rules: StopRules = PLAIN) -> list[str]:
    """Feed `tokens` as a scheduler would: each with the rules' verdict on it."""
    pieces = []
    for n, token in enumerate(tokens, 1):
        step = stream.push(token, ends=rules.check(n, token))
        pieces.append(step.text)
        if step.finished:
            break
    return pieces


def test_text_arrives_token_by_token_and_length_finishes():
    stream = TextStream(decode)
    assert run(stream, [0, 1, 2, 3], StopRules(max_tokens=3)) == ["Hello", ",", " world"]
    assert stream.finish_reason == "length" and stream.tokens == 3


def test_eos_finishes_with_stop_and_counts_the_token():
    stream = TextStream(decode)
    assert "".join(run(stream, [0, 3, 6, 9], StopRules(max_tokens=10, end_ids=frozenset({6})))) == "Hello."
    assert stream.finish_reason == "stop" and stream.tokens == 3


def test_stop_string_across_tokens_is_held_back_then_cut():
    stream = TextStream(decode, stop=[" STOP"])
    pieces = run(stream, [0, 7, 8, 9])
    assert pieces == ["Hello", "", ""]  # " ST" might start " STOP": held, then the stop is cut
    assert stream.output == "Hello" and stream.finish_reason == "stop"


def test_held_back_text_goes_out_when_it_is_not_a_stop():
    stream = TextStream(decode, stop=[" STOP"])
    pieces = run(stream, [0, 7, 9, 3])
    assert "".join(pieces) == "Hello ST more."
    assert pieces[1] == ""  # held while " ST" could still become " STOP"


def test_stop_inside_one_token():
    stream = TextStream(decode, stop=["wor"])
    assert "".join(run(stream, [0, 2])) == "Hello "
    assert stream.finish_reason == "stop"


def test_half_a_character_is_held_until_complete():
    # a byte-level tokenizer can split "é" over two tokens; decode shows U+FFFD until it is whole
    vocab = {0: b"caf", 1: b"\xc3", 2: b"\xa9", 3: b"!"}

    def byte_decode(ids) -> str:
        return b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace")

    stream = TextStream(byte_decode)
    assert run(stream, [0, 1, 2, 3]) == ["caf", "", "é", "!"]


def test_end_flushes_held_text():
    stream = TextStream(decode, stop=[" STOP"])
    run(stream, [0, 7])
    step = stream.end()
    assert step.text == " ST" and step.finished == "length"


def test_push_after_finish_is_an_error():
    stream = TextStream(decode)
    stream.push(0, ends="length")
    with pytest.raises(RuntimeError):
        stream.push(1)


def test_a_stop_string_on_the_last_allowed_token_finishes_with_stop():
    stream = TextStream(decode, stop=[" STOP"])
    run(stream, [0, 7, 8], StopRules(max_tokens=3))
    assert stream.finish_reason == "stop" and stream.output == "Hello"


def test_rules_of_a_request():
    eos = (6,)
    plain = StopRules.of(SamplingParams(max_tokens=4, stop_token_ids=(9,)), eos)
    assert [plain.check(1, t) for t in (6, 9, 0)] == ["stop", "stop", None]
    assert plain.check(4, 0) == "length" and plain.check(4, 6) == "stop"  # the end token wins at the limit
    early = StopRules.of(SamplingParams(max_tokens=4, min_tokens=2), eos)
    assert early.check(2, 6) is None and early.check(3, 6) == "stop"  # an end token counts past min_tokens
    ignoring = StopRules.of(SamplingParams(max_tokens=4, ignore_eos=True, stop_token_ids=(9,)), eos)
    assert ignoring.check(1, 6) is None and ignoring.check(1, 9) == "stop"


def test_min_tokens_holds_off_stop_strings():
    stream = TextStream(decode, stop=["Hello"], min_tokens=2)
    assert stream.push(0).finished is None  # "Hello" as the first of at least 2 tokens: no stop yet
    assert stream.push(1).finished == "stop"
