"""FAKE engines for tests: no model, no torch calls except a faked out-of-memory.

They have the methods of the real engines, sleep to look slow, record every batch they run,
and misbehave on request:
- an input containing "boom" makes the whole batch raise (a bad request); for generation,
  after its first token (so the error comes after the stream started);
- a batch of more than `oom_above` inputs raises torch.OutOfMemoryError (labelled FAKE).
The fake generation engine runs under both schedulers: `generate` per batch, and a
`FakeStepEngine` for continuous batching that makes the same tokens step by step.

`tests/fake_server.py` serves them through the same runner as `accelab serve`; `tests/serving.py`
runs servers for tests.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from typing import Any

from accelab.serve.engines.base import Completion, GenUnit, Label, Prompt, StepInput, TextInput, fit_prompt
from accelab.serve.stops import StopRules
from accelab.serve.textstream import TextStream

POISON = "boom"


class FakeModelError(RuntimeError):
    pass


class _FakeBase:
    device = "n/a"  # no model runs
    worker = "batches"  # who schedules its jobs (a real engine's serve path says)

    def __init__(self, *, name: str, delay_s: float = 0.0, oom_above: int | None = None):
        self.name = name
        self.delay_s = delay_s
        self.oom_above = oom_above
        self.batches: list[int] = []  # size of every batch run (failed ones included)
        self.lock = threading.Lock()
        self.closed = False

    def _enter_batch(self, size: int, poisoned: bool) -> None:
        with self.lock:
            self.batches.append(size)
        if self.oom_above is not None and size > self.oom_above:
            import torch

            raise torch.OutOfMemoryError(f"FAKE out of memory: {size} inputs > {self.oom_above} (a test fake)")
        time.sleep(self.delay_s)
        if poisoned:
            raise FakeModelError(f"FAKE model error: an input contains {POISON!r} (a test fake)")

    def warmup(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


class FakeEmbeddingEngine(_FakeBase):
    """Deterministic 8-dimensional unit vectors from a hash of the text; one token per word."""

    task = "feature-extraction"

    def prepare_text(self, text: str | list[int], *, truncate: bool = False, where: str = "input") -> TextInput:
        if isinstance(text, list):
            return TextInput(ids=tuple(text))
        if not text:
            raise ValueError(f"{where} is empty; send at least one token of text")
        return TextInput(ids=tuple(word_id(w) for w in text.split()) or (0,))

    def embed(self, units: list[TextInput]) -> list[list[float]]:
        self._enter_batch(len(units), any(word_id(POISON) in u.ids for u in units))
        return [_unit_vector(u.ids) for u in units]


class FakeClassificationEngine(_FakeBase):
    task = "image-classification"

    def prepare_image(self, data: str, *, top_k: int = 5, where: str = "image") -> Any:
        from accelab.serve.engines.base import ImageInput
        from accelab.serve.images import decode_image

        image = decode_image(data, where=where)
        return ImageInput(pixels=image.size, top_k=top_k)

    def classify(self, units: list[Any]) -> list[list[Label]]:
        self._enter_batch(len(units), False)
        return [
            [Label(label=f"class-{(w * h + k) % 10}", score=1.0 / (k + 2)) for k in range(u.top_k)]
            for u in units
            for (w, h) in [u.pixels]
        ]


class FakeGenerationEngine(_FakeBase):
    """Generates the words "w0 w1 w2 ..." one per step of `delay_s`; the prompt's words are its
    tokens. Honours max_tokens (the real StopRules) and stop strings (the real TextStream)."""

    task = "text-generation"
    worker = "continuous"  # its FakeStepEngine steps sequences; the static worker when --scheduler static
    eos_ids: tuple[int, ...] = ()
    max_context: int | None = None
    vocab_size: int | None = None

    def decode(self, ids: Any) -> str:
        return _fake_decode(ids)

    def fit(self, prompt: Prompt, max_tokens: int, *, truncate: bool = False) -> Prompt:
        return fit_prompt(prompt, max_tokens, self.max_context, truncate=truncate, name=self.name)

    def step_engine(self, limits: Any) -> FakeStepEngine:
        self.stepper = FakeStepEngine(self)
        return self.stepper

    def prepare_chat(self, messages: list[dict[str, Any]]) -> Prompt:
        text = " ".join(
            m["content"] if isinstance(m["content"], str) else " ".join(p.get("text", "") for p in m["content"])
            for m in messages
        )
        return self.prepare_text(text)

    def prepare_text(self, prompt: str | list[int]) -> Prompt:
        ids = tuple(prompt) if isinstance(prompt, list) else tuple(word_id(w) for w in prompt.split())
        if not ids:
            raise ValueError("prompt is empty; send at least one token of text")
        return Prompt(ids=ids, prompt_tokens=len(ids))

    def generate(self, units: list[GenUnit]) -> list[Completion]:
        poisoned = any(word_id(POISON) in u.prompt.ids for u in units)
        self._enter_batch(len(units), False)
        streams = [TextStream(_fake_decode, stop=u.params.stop) for u in units]
        rules = [StopRules.of(u.params) for u in units]
        finished_at = [0.0] * len(units)
        for step in range(max(u.params.max_tokens for u in units)):
            if step == 1 and poisoned:
                raise FakeModelError(f"FAKE model error: an input contains {POISON!r} (a test fake)")
            if step:
                time.sleep(self.delay_s)
            now = time.monotonic()
            for row, (unit, stream) in enumerate(zip(units, streams)):
                if stream.finish_reason is None and not unit.cancelled:
                    unit.note_token(now)
                    result = stream.push(step, ends=rules[row].check(stream.tokens + 1, step))
                    unit.emit(result.text)
                    finished_at[row] = now
            if all(s.finish_reason is not None or u.cancelled for s, u in zip(streams, units)):
                break
        return [
            Completion(
                text=s.output,
                finish_reason=s.finish_reason or "length",
                prompt_tokens=u.prompt.prompt_tokens,
                completion_tokens=s.tokens,
                first_token_at=u.first_token_at,
                finished_at=finished_at[i],
            )
            for i, (u, s) in enumerate(zip(units, streams))
        ]


class FakeStepEngine:
    """The fake generation engine's continuous steps: a token after a prompt word is 0, after
    token k it is k + 1 (so every sequence reads " w0 w1 w2 ..."). Sleeps `delay_s` per step,
    records each step's inputs, and fails a poisoned sequence's second token."""

    name = "FAKE step engine (a test fake)"
    kv_bytes_per_token = 1000

    def __init__(self, owner: FakeGenerationEngine):
        self.owner = owner
        self.steps: list[list[StepInput]] = []
        self.released: list[int] = []
        self.closed = False
        self._poisoned: set[int] = set()

    def step(self, inputs: list[StepInput]) -> list[int]:
        self.steps.append(list(inputs))
        time.sleep(self.owner.delay_s)
        for item in inputs:
            if word_id(POISON) in item.tokens:
                self._poisoned.add(item.seq_id)
            if item.seq_id in self._poisoned and item.tokens[-1] == 0:
                raise FakeModelError(f"FAKE model error: an input contains {POISON!r} (a test fake)")
        return [0 if item.tokens[-1] >= WORD_IDS else item.tokens[-1] + 1 for item in inputs if item.sample]

    def release(self, seq_id: int) -> None:
        self.released.append(seq_id)

    def close(self) -> None:
        self.closed = True


def _fake_decode(ids: Any) -> str:
    return "".join(f" w{i}" for i in ids)


WORD_IDS = 1 << 30  # a prompt word's id is at least this; generated tokens are counts below it


def word_id(word: str) -> int:
    return int.from_bytes(hashlib.blake2b(word.encode(), digest_size=4).digest(), "little") | WORD_IDS


def _unit_vector(ids: tuple[int, ...]) -> list[float]:
    digest = hashlib.blake2b(repr(ids).encode(), digest_size=8).digest()
    raw = [b - 127.5 for b in digest]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [x / norm for x in raw]


FAKES = {"embed": FakeEmbeddingEngine, "generate": FakeGenerationEngine, "classify": FakeClassificationEngine}
