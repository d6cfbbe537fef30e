"""FAKE engines for tests and demos: no model, no torch calls except a faked out-of-memory.

They have the methods of the real engines, sleep to look slow, record every batch they run,
and misbehave on request:
- an input containing "boom" makes the whole batch raise (a bad request); for generation,
  after its first token (so the error comes after the stream started);
- a batch of more than `oom_above` inputs raises torch.OutOfMemoryError (labelled FAKE).
The fake generation engine runs under both schedulers: `generate` per batch, and a
`FakeStepEngine` for continuous batching that makes the same tokens step by step.

`python -m accelab.serve.testing --port 0 --delay 0.5` runs a fake server through the same
runner as `accelab serve` (signals, grace period), for the SIGTERM test.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from accelab.serve.engines.base import Completion, GenUnit, Label, Prompt, StepInput, TextInput, fit_prompt
from accelab.serve.textstream import TextStream

POISON = "boom"


class FakeModelError(RuntimeError):
    pass


class _FakeBase:
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
        return TextInput(ids=tuple(_word_id(w) for w in text.split()) or (0,))

    def embed(self, units: list[TextInput]) -> list[list[float]]:
        self._enter_batch(len(units), any(_word_id(POISON) in u.ids for u in units))
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
        return [[Label(label=f"class-{(w * h + k) % 10}", score=1.0 / (k + 2)) for k in range(u.top_k)]
                for u in units for (w, h) in [u.pixels]]


class FakeGenerationEngine(_FakeBase):
    """Generates the words "w0 w1 w2 ..." one per step of `delay_s`; the prompt's words are its
    tokens. Honours max_tokens and stop strings through the real TextStream."""

    task = "text-generation"
    eos_ids: tuple[int, ...] = ()
    max_context: int | None = None

    def decode(self, ids: Any) -> str:
        return _fake_decode(ids)

    def fit(self, prompt: Prompt, max_tokens: int, *, truncate: bool = False) -> Prompt:
        return fit_prompt(prompt, max_tokens, self.max_context, truncate=truncate, name=self.name)

    def step_engine(self, limits: Any) -> "FakeStepEngine":
        self.stepper = FakeStepEngine(self)
        return self.stepper

    def prepare_chat(self, messages: list[dict[str, Any]]) -> Prompt:
        text = " ".join(m["content"] if isinstance(m["content"], str) else
                        " ".join(p.get("text", "") for p in m["content"]) for m in messages)
        return self.prepare_text(text)

    def prepare_text(self, prompt: str | list[int]) -> Prompt:
        ids = tuple(prompt) if isinstance(prompt, list) else tuple(_word_id(w) for w in prompt.split())
        if not ids:
            raise ValueError("prompt is empty; send at least one token of text")
        return Prompt(ids=ids, prompt_tokens=len(ids))

    def generate(self, units: list[GenUnit]) -> list[Completion]:
        poisoned = any(_word_id(POISON) in u.prompt.ids for u in units)
        self._enter_batch(len(units), False)
        streams = [TextStream(_fake_decode, max_tokens=u.params.max_tokens, stop=u.params.stop) for u in units]
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
                    result = stream.push(step)
                    unit.emit(result.text)
                    finished_at[row] = now
            if all(s.finish_reason is not None or u.cancelled for s, u in zip(streams, units)):
                break
        return [Completion(text=s.output, finish_reason=s.finish_reason or "length",
                           prompt_tokens=u.prompt.prompt_tokens, completion_tokens=s.tokens,
                           first_token_at=u.first_token_at, finished_at=finished_at[i])
                for i, (u, s) in enumerate(zip(units, streams))]


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
            if _word_id(POISON) in item.tokens:
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


def _word_id(word: str) -> int:
    return int.from_bytes(hashlib.blake2b(word.encode(), digest_size=4).digest(), "little") | WORD_IDS


def _unit_vector(ids: tuple[int, ...]) -> list[float]:
    digest = hashlib.blake2b(repr(ids).encode(), digest_size=8).digest()
    raw = [b - 127.5 for b in digest]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [x / norm for x in raw]


@contextlib.contextmanager
def running_server(app: Any, *, host: str = "127.0.0.1", ready_timeout_s: float = 60.0) -> Iterator[str]:
    """Serve `app` with uvicorn in a background thread on a free port; yields its base URL once
    /readyz answers 200, and always stops the server (and the app's worker) on exit."""
    import httpx
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="on",
                                           timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="test-server", daemon=True)
    thread.start()
    url = f"http://{host}:{port}"
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError(f"test server at {url} not ready after {ready_timeout_s} s")
            time.sleep(0.02)
        yield url
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


class ServerProcess:
    """`python -m <module> ... --port 0` as a child process; reads its URL from the 'listening
    on' line. Always `stop()` it (or use it as a context manager): SIGTERM, then kill."""

    def __init__(self, *args: str, timeout_s: float = 60.0, env: dict[str, str] | None = None):
        self.proc = subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("server did not start:\n" + "".join(self.log)) from None
                continue
            match = re.search(r"listening on (http://[\d.]+:\d+)", line)
            if match:
                self.url = match.group(1)
                return

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            self.lines.put(line)

    def wait_ready(self, timeout_s: float = 120.0) -> list[int]:
        """Poll /readyz until 200; returns the statuses seen (503 while loading)."""
        import httpx

        statuses: list[int] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                statuses.append(httpx.get(f"{self.url}/readyz", timeout=5).status_code)
            except httpx.TransportError:
                statuses.append(0)
            if statuses[-1] == 200:
                return statuses
            time.sleep(0.05)
        raise RuntimeError("server not ready:\n" + "".join(self.log))

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


FAKES = {"embed": FakeEmbeddingEngine, "generate": FakeGenerationEngine, "classify": FakeClassificationEngine}


def main(argv: list[str] | None = None) -> int:
    from accelab.serve.config import ServeConfig
    from accelab.serve.server import run_server

    parser = argparse.ArgumentParser(description="A FAKE accelab server (for tests): no model, slow on purpose.")
    parser.add_argument("--kind", choices=sorted(FAKES), default="embed")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--delay", type=float, default=0.2, help="seconds per batch (per token for generate)")
    parser.add_argument("--max-batch-size", type=int, default=4)
    parser.add_argument("--max-queue", type=int, default=64)
    parser.add_argument("--grace-period", type=float, default=10.0)
    parser.add_argument("--load-delay", type=float, default=0.0, help="seconds the fake model takes to load")
    args = parser.parse_args(argv)
    config = ServeConfig(model_name=f"fake-{args.kind}", plan_name="fake", port=args.port,
                         max_batch_size=args.max_batch_size, max_queue=args.max_queue,
                         grace_period_s=args.grace_period)

    def factory() -> Any:
        time.sleep(args.load_delay)
        return FAKES[args.kind](name=config.model_name, delay_s=args.delay)

    return run_server(config, factory)


if __name__ == "__main__":
    raise SystemExit(main())
