"""Token ids to streamed text for one sequence: incremental detokenisation and stop strings.
Whether a token ends the sequence (end of sequence, stop token ids, max_tokens, min_tokens) is
decided by `accelab.serve.stops.StopRules` where the sequence is scheduled; the stream is told
(`push(token, ends=...)`) and only turns ids into text. Pure: the decoder is injected
(`tokenizer.decode` in the server, a dict lookup in tests).

Incremental decoding keeps two offsets (the approach of text-generation-inference): the text
of tokens [prefix:read) already went out; decoding [prefix:) and taking what lies past it
gives the new text, held back while it ends in U+FFFD (half of a multi-byte character).
Stop strings: text that could still be the start of a stop string is held back until it
either completes one (the stream ends before it) or cannot (it goes out). Before `min_tokens`
tokens no stop string ends the stream.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from accelab.serve.stops import FinishReason

__all__ = ["FinishReason", "Step", "TextStream", "stream_for"]


@dataclass(frozen=True, slots=True)
class Step:
    text: str  # new text to send now (may be empty)
    finished: FinishReason | None  # set on the step that ends the sequence


def stream_for(params: Any, decode: Callable[[Sequence[int]], str]) -> TextStream:
    """The stream of one sequence with SamplingParams `params`."""
    return TextStream(decode, stop=params.stop, min_tokens=params.min_tokens)


class TextStream:
    def __init__(self, decode: Callable[[Sequence[int]], str], *, stop: Sequence[str] = (), min_tokens: int = 0):
        self._decode = decode
        self._stop = [s for s in stop if s]
        self._min_tokens = min_tokens  # before this many tokens, no stop string ends the stream
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._stop_token = False  # the last id ended the sequence as a stop token: it is no text
        self.text = ""  # all decoded text (before stop truncation)
        self.sent = 0  # characters of `text` already handed out
        self.finish_reason: FinishReason | None = None

    @property
    def tokens(self) -> int:
        """Completion tokens generated, the end-of-sequence token included."""
        return len(self.ids)

    @property
    def ended_on_stop_token(self) -> bool:
        """The last token is an end-of-sequence or stop token (not part of the text)."""
        return self._stop_token

    @property
    def output(self) -> str:
        return self.text[: self.sent]

    def push(self, token: int, *, ends: FinishReason | None = None) -> Step:
        """The sequence's next token; `ends`: the scheduler's verdict on it ("stop": an end or
        stop token, which adds no text; "length": the last one max_tokens allows)."""
        if self.finish_reason is not None:
            raise RuntimeError("push after the stream finished")
        self.ids.append(token)
        if ends == "stop":
            self._stop_token = True
            self.text += self._decode_rest()
            hit = self._find_stop()
            return self._finish("stop", flush_to=len(self.text) if hit is None else hit)
        self.text += self._new_text()
        hit = self._find_stop() if len(self.ids) >= self._min_tokens else None
        if hit is not None:
            return self._finish("stop", flush_to=hit)
        if ends == "length":
            self.text += self._decode_rest()
            return self._finish("length", flush_to=len(self.text))
        safe = len(self.text) - self._held_back()
        return Step(self._emit(safe), None)

    def end(self) -> Step:
        """The model stopped without a reason of ours (its own criteria): flush what is held."""
        if self.finish_reason is not None:
            return Step("", self.finish_reason)
        self.text += self._decode_rest()
        hit = self._find_stop()
        return self._finish("stop" if hit is not None else "length", flush_to=len(self.text) if hit is None else hit)

    # -- internals ----------------------------------------------------------------------
    def _new_text(self) -> str:
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before) :]
        return ""

    def _decode_rest(self) -> str:
        """Whatever the last tokens hold, even half a character, once the stream is over."""
        ids = self.ids[:-1] if self._stop_token else self.ids
        before = self._decode(ids[self._prefix : self._read])
        after = self._decode(ids[self._prefix :])
        return after[len(before) :] if len(after) > len(before) else ""

    def _find_stop(self) -> int | None:
        # only the part not sent yet (plus a stop string's length back) can hold a new match
        start = max(0, self.sent - max((len(s) for s in self._stop), default=0))
        hits = [i for i in (self.text.find(s, start) for s in self._stop) if i >= 0]
        return min(hits) if hits else None

    def _held_back(self) -> int:
        """Length of the longest tail of the text that begins some stop string."""
        longest = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _emit(self, upto: int) -> str:
        upto = max(upto, self.sent)
        out, self.sent = self.text[self.sent : upto], upto
        return out

    def _finish(self, reason: FinishReason, *, flush_to: int) -> Step:
        self.finish_reason = reason
        return Step(self._emit(flush_to), reason)
