"""The HTTP side of a load test: OpenAI-protocol requests with aiohttp, sent open loop (on a
schedule of arrival times, whatever the server's pace) or closed loop (N users, each sending
its next request when the last one answered). Works against any OpenAI-compatible server, not
only `accelab serve`.

aiohttp rather than httpx: a load generator should spend its CPU on requests, not on itself,
above all when it shares the machine with the server; per request aiohttp needs a fraction of
httpx's CPU. Embeddings are asked for as base64, as the official openai client does.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Final, Literal

import aiohttp
import httpx

from accelab.loadtest.schedule import arrival_times
from accelab.loadtest.summary import RequestRecord

log = logging.getLogger(__name__)

Endpoint = Literal["chat", "completions", "embeddings"]
# `accelab loadtest` options named apart from the LoadConfig field they set; the other options
# named like a field set it (LoadTestRequest.from_options; tests/test_command_options.py checks them)
OPTION_FIELDS: Final = {"duration": "duration_s", "timeout": "timeout_s"}
FROM_OTHER_OPTIONS: Final = frozenset({"inputs", "rate", "concurrency", "max_tokens", "images"})  # see from_options
MIN_REQUESTS = 10  # an open-loop run sends at least this many (or --requests), whatever the duration
ENDPOINTS: dict[str, str] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadConfig:
    url: str
    endpoint: Endpoint = "chat"
    inputs: tuple[str, ...]  # prompts or sentences, used in turn
    model: str | None = None  # None: the first model of GET /v1/models
    rate: float | None = None  # open loop, requests/s
    concurrency: int | None = None  # closed loop
    burstiness: float = 1.0
    duration_s: float = 30.0
    requests: int | None = None
    warmup: int = 2
    max_tokens: int | tuple[int, ...] = 32  # several: request i asks for max_tokens[i % n] (a mixed load)
    stream: bool = True
    timeout_s: float = 60.0
    api_key: str | None = None
    seed: int = 0
    max_in_flight: int = 1024  # open loop: arrivals past this many unanswered requests fail at once
    images: tuple[str, ...] = ()  # chat: data URIs, sent in turn after each prompt (accelab.loadtest.images)
    images_per_request: int = 1
    images_every: int = 1  # chat with images: every Nth request carries them, the others are text only

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint={self.endpoint!r} is not one of {', '.join(ENDPOINTS)}")
        if (self.rate is None) == (self.concurrency is None):
            raise ValueError("give exactly one of --rate (open loop, requests/s) or --concurrency (closed loop)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency={self.concurrency} must be 1 or more")
        if self.duration_s <= 0:
            raise ValueError(f"duration={self.duration_s} must be more than 0 seconds")
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"requests={self.requests} must be 1 or more")
        if not self.inputs:
            raise ValueError("no inputs to send; check --prompts-file")
        if self.images and self.endpoint != "chat":
            raise ValueError(f"--images goes with --endpoint chat, not {self.endpoint}")
        if self.images_every < 1:
            raise ValueError(f"images_every={self.images_every} must be 1 or more")
        if self.images_per_request < 1:
            raise ValueError(f"images_per_request={self.images_per_request} must be 1 or more")
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight={self.max_in_flight} must be 1 or more")
        if not self.max_tokens_cycle or min(self.max_tokens_cycle) < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be 1 or more (or a list of such)")

    @property
    def max_tokens_cycle(self) -> tuple[int, ...]:
        return self.max_tokens if isinstance(self.max_tokens, tuple) else (self.max_tokens,)

    @property
    def base_url(self) -> str:
        return normalise_url(self.url)

    @property
    def streams(self) -> bool:
        return self.stream and self.endpoint != "embeddings"


def parse_max_tokens(text: str) -> int | tuple[int, ...]:
    """'32' -> 32; '16,128,32' -> (16, 128, 32)."""
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"--max-tokens {text!r}: give a number (32) or a comma-separated list (16,128,32)") from None
    if not values:
        raise ValueError("--max-tokens is empty; give a number (32) or a list (16,128,32)")
    return values[0] if len(values) == 1 else values


def normalise_url(url: str) -> str:
    """'127.0.0.1:8000', 'http://host:8000/v1/' -> 'http://host:8000'."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url[: -len("/v1")] if url.endswith("/v1") else url


def discover_model(config: LoadConfig) -> str:
    if config.model:
        return config.model
    response = httpx.get(f"{config.base_url}/v1/models", headers=_headers(config), timeout=config.timeout_s)
    response.raise_for_status()
    models = response.json().get("data", [])
    if not models:
        raise ValueError(f"{config.base_url}/v1/models lists no model; pass --model")
    return models[0]["id"]


def run_load(config: LoadConfig, model: str, *, rate: float | None = None) -> list[RequestRecord]:
    """Warm up, then measure; `rate` overrides the config's (find-max probes)."""
    return asyncio.run(_run(config, model, rate if rate is not None else config.rate))


async def _run(config: LoadConfig, model: str, rate: float | None) -> list[RequestRecord]:
    connector = aiohttp.TCPConnector(limit=0, force_close=False)  # no pool limit: --max-in-flight bounds it
    # like a read timeout: at most timeout_s without a byte (a long stream that keeps sending is fine)
    timeout = aiohttp.ClientTimeout(total=None, connect=10.0, sock_read=config.timeout_s)
    async with aiohttp.ClientSession(headers=_headers(config), connector=connector, timeout=timeout) as session:
        sender = _Sender(config, session, model)
        if config.warmup:
            await asyncio.gather(*(sender.one(i, time.perf_counter()) for i in range(config.warmup)))
        if rate is not None:
            return await _open_loop(sender, config, rate)
        return await _closed_loop(sender, config)


async def _open_loop(sender: _Sender, config: LoadConfig, rate: float) -> list[RequestRecord]:
    schedule = arrival_times(
        rate, n=config.requests, duration_s=config.duration_s, burstiness=config.burstiness, seed=config.seed
    )
    floor = min(MIN_REQUESTS, config.requests or MIN_REQUESTS)
    if len(schedule) < floor:  # a low rate (a find-max probe) still gets a few requests: past --duration
        schedule = arrival_times(rate, n=floor, burstiness=config.burstiness, seed=config.seed)
    t0 = time.perf_counter()
    tasks = []
    refused: list[RequestRecord] = []
    for index, at in enumerate(schedule):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if sender.in_flight >= config.max_in_flight:
            # far past the server's capacity: more open connections would only swamp this machine
            now = time.perf_counter() - t0
            refused.append(
                RequestRecord(
                    start=now,
                    end=now,
                    status="error:client-limit",
                    error=f"{config.max_in_flight} requests unanswered (--max-in-flight)",
                )
            )
            continue
        tasks.append(asyncio.create_task(sender.one(config.warmup + index, t0)))
    return list(await asyncio.gather(*tasks)) + refused


async def _closed_loop(sender: _Sender, config: LoadConfig) -> list[RequestRecord]:
    t0 = time.perf_counter()
    counter = itertools.count(config.warmup)
    limit = config.warmup + (config.requests or 10**12)
    records: list[RequestRecord] = []

    async def user() -> None:
        while time.perf_counter() - t0 < config.duration_s:
            index = next(counter)
            if index >= limit:
                return
            records.append(await sender.one(index, t0))

    await asyncio.gather(*(user() for _ in range(config.concurrency or 1)))
    return records


class _Sender:
    def __init__(self, config: LoadConfig, session: aiohttp.ClientSession, model: str):
        self.config = config
        self.session = session
        self.model = model
        self.url = config.base_url + ENDPOINTS[config.endpoint]
        self.in_flight = 0

    def body(self, index: int) -> dict[str, Any]:
        text = self.config.inputs[index % len(self.config.inputs)]
        if self.config.endpoint == "embeddings":
            return {"model": self.model, "input": text, "encoding_format": "base64"}
        cycle = self.config.max_tokens_cycle
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": cycle[index % len(cycle)],
            "temperature": 0,
            "stream": self.config.streams,
        }
        if self.config.streams:
            body["stream_options"] = {"include_usage": True}
        if self.config.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": self._content(text, index)}]
        else:
            body["prompt"] = text
        return body

    def _content(self, text: str, index: int) -> str | list[dict[str, Any]]:
        """The prompt, then request `index`'s images (the next images_per_request of the pool;
        none on the requests between every images_every-th)."""
        pool, k = self.config.images, self.config.images_per_request
        if not self.images_of(index):
            return text
        n = index // self.config.images_every
        images = [{"type": "image_url", "image_url": {"url": pool[(n * k + j) % len(pool)]}} for j in range(k)]
        return [{"type": "text", "text": text}, *images]

    def images_of(self, index: int) -> int:
        """How many images request `index` sends."""
        if not self.config.images or index % self.config.images_every:
            return 0
        return self.config.images_per_request

    async def one(self, index: int, t0: float) -> RequestRecord:
        record = RequestRecord(start=time.perf_counter() - t0, end=0.0, status="", images=self.images_of(index))
        self.in_flight += 1
        try:
            for attempt in range(2):
                try:
                    await self._send(index, t0, record)
                    break
                except STALE_CONNECTION:
                    # a kept-alive connection the server had closed (llama-server closes one after a
                    # few requests): nothing was answered on it, so the request goes again on a fresh
                    # one, once, as HTTP clients do; its latency counts from the first try
                    if attempt or record.status:
                        raise
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as err:
            record.status = f"error:{_error_name(err)}"
            record.error = str(err)[:300] or _error_name(err)
        finally:
            self.in_flight -= 1
        record.end = time.perf_counter() - t0
        return record

    async def _send(self, index: int, t0: float, record: RequestRecord) -> None:
        async with self.session.post(self.url, json=self.body(index)) as response:
            record.status = str(response.status)
            if response.status != 200:
                record.error = (await response.read()).decode(errors="replace")[:300]
            elif self.config.streams:
                await self._streamed(response, t0, record)
            else:
                _count_usage(record, json.loads(await response.read()).get("usage"))

    async def _streamed(self, response: aiohttp.ClientResponse, t0: float, record: RequestRecord) -> None:
        async for raw in response.content:  # one SSE line at a time
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                record.error = str(chunk["error"].get("message", chunk["error"]))[:300]
                continue
            if _content(chunk):
                now = time.perf_counter() - t0
                record.chunk_times.append(now)
                if record.ttft is None:
                    record.ttft = now - record.start
            if chunk.get("usage"):
                _count_usage(record, chunk["usage"])
        if record.output_tokens == 0:  # a server without usage in streams: one token per chunk
            record.output_tokens = len(record.chunk_times)


STALE_CONNECTION = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


def _error_name(err: BaseException) -> str:
    return "Timeout" if isinstance(err, asyncio.TimeoutError) else type(err).__name__


def _content(chunk: dict[str, Any]) -> str:
    pieces = []
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta")
        pieces.append((delta or {}).get("content") or "" if delta is not None else choice.get("text") or "")
    return "".join(pieces)


def _count_usage(record: RequestRecord, usage: dict[str, Any] | None) -> None:
    if usage:
        record.output_tokens = int(usage.get("completion_tokens") or 0)
        record.prompt_tokens = int(usage.get("prompt_tokens") or 0)


def _headers(config: LoadConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
