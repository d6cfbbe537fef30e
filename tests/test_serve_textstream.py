"""Incremental detokenisation with stop strings, max_tokens and EOS (a fake decoder)."""

from __future__ import annotations

import pytest

from accelab.serve.textstream import TextStream

VOCAB = {0: "Hello", 1: ",", 2: " world", 3: ".", 4: " The", 5: " end", 6: "</s>", 7: " ST", 8: "OP", 9: " more"}


def decode(ids) -> str:
    return "".join(VOCAB[i] for i in ids if i != 6)


def run(stream: TextStream, tokens: list[int]) -> list[str]:
    pieces = []
    for token in tokens:
        step = stream.push(token)
        pieces.append(step.text)
        if step.finished:
            break
    return pieces


def test_text_arrives_token_by_token_and_length_finishes():
    stream = TextStream(decode, max_tokens=3)
    assert run(stream, [0, 1, 2, 3]) == ["Hello", ",", " world"]
    assert stream.finish_reason == "length" and stream.tokens == 3


def test_eos_finishes_with_stop_and_counts_the_token():
    stream = TextStream(decode, max_tokens=10, eos_ids=[6])
    assert "".join(run(stream, [0, 3, 6, 9])) == "Hello."
    assert stream.finish_reason == "stop" and stream.tokens == 3


def test_stop_string_across_tokens_is_held_back_then_cut():
    stream = TextStream(decode, max_tokens=10, stop=[" STOP"])
    pieces = run(stream, [0, 7, 8, 9])
    assert pieces == ["Hello", "", ""]  # " ST" might start " STOP": held, then the stop is cut
    assert stream.output == "Hello" and stream.finish_reason == "stop"


def test_held_back_text_goes_out_when_it_is_not_a_stop():
    stream = TextStream(decode, max_tokens=10, stop=[" STOP"])
    pieces = run(stream, [0, 7, 9, 3])
    assert "".join(pieces) == "Hello ST more."
    assert pieces[1] == ""  # held while " ST" could still become " STOP"


def test_stop_inside_one_token():
    stream = TextStream(decode, max_tokens=10, stop=["wor"])
    assert "".join(run(stream, [0, 2])) == "Hello "
    assert stream.finish_reason == "stop"


def test_half_a_character_is_held_until_complete():
    # a byte-level tokenizer can split "é" over two tokens; decode shows U+FFFD until it is whole
    vocab = {0: b"caf", 1: b"\xc3", 2: b"\xa9", 3: b"!"}

    def byte_decode(ids) -> str:
        return b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace")

    stream = TextStream(byte_decode, max_tokens=10)
    assert run(stream, [0, 1, 2, 3]) == ["caf", "", "é", "!"]


def test_end_flushes_held_text():
    stream = TextStream(decode, max_tokens=10, stop=[" STOP"])
    run(stream, [0, 7])
    step = stream.end()
    assert step.text == " ST" and step.finished == "length"


def test_push_after_finish_is_an_error():
    stream = TextStream(decode, max_tokens=1)
    stream.push(0)
    with pytest.raises(RuntimeError):
        stream.push(1)
