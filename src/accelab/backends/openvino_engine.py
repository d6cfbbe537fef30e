"""accelab's OpenVINO GenAI engine process: a ContinuousBatchingPipeline (OpenVINO's paged
attention, scheduler and prefix cache) behind a Unix socket, in the OpenVINO GenAI venv.

    .venv-openvino/bin/python -P src/accelab/backends/openvino_engine.py --config JSON --socket PATH

It speaks the same `engine_wire` messages as accelab's vLLM engine process (token ids in, token
ids out), so accelab's measuring (`accelab.backends.engine_model`) and serving
(`accelab.serve.engines.vllm_worker`) code is one for both. Threads: one engine thread owns the
pipeline (adds requests, steps, reads each request's new tokens, stops aborted ones); a reader
thread per client decodes its messages into the engine's inbox; `Score` (perplexity) runs on the
reader thread through the exported graph itself (`openvino_scorer.py`: the pipeline returns no
prompt log-probabilities).

The socket appears only once the pipeline is compiled; the process outlives its last client by
`keep_s` seconds (0: it leaves with its last client, or when the process that started it is gone).
Standard library, numpy, openvino and openvino_genai only (no accelab in this venv); `-P` keeps this
directory off sys.path, and the siblings it runs (`engine_wire.py`, `openvino_scorer.py`) load by
file path.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import logging
import os
import queue
import random
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("accelab.openvino_engine")

BLOCK_SIZE = 32  # tokens per KV block on OpenVINO's CPU plugin
_TYPES = {"f32": "f32", "bf16": "bf16", "u8": "u8"}
_ELEMENT_BYTES = {"f32": 4, "bf16": 2, "u8": 1}


def _load_sibling(name: str) -> Any:
    """accelab's module `name` beside this file, by file path (accelab itself is not importable in this venv)."""
    spec = importlib.util.spec_from_file_location(f"accelab_{name}", Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while they are built
    spec.loader.exec_module(module)
    return module


W = _load_sibling("engine_wire")
Scorer = _load_sibling("openvino_scorer").Scorer


def kv_blocks(model_dir: Path, kv_precision: str, pool_bytes: int) -> tuple[int, int]:
    """(blocks of the pool, the model's context): a token holds K and V of every layer's KV heads
    (u8 adds a scale and a zero point per head)."""
    config = json.loads((model_dir / "config.json").read_text())
    layers = config["num_hidden_layers"]
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_head = head_dim * _ELEMENT_BYTES[kv_precision] + (8 if kv_precision == "u8" else 0)
    per_token = 2 * layers * heads * per_head
    return max(1, pool_bytes // (per_token * BLOCK_SIZE)), int(config.get("max_position_embeddings") or 2048)


class Engine:
    """The pipeline and the requests in it; every pipeline call happens on `run`'s thread."""

    def __init__(self, config: Any):
        import openvino_genai as genai

        started = time.perf_counter()
        model = Path(config.model)
        blocks, context = kv_blocks(model, config.kv_precision, config.kv_cache_bytes)
        scheduler = genai.SchedulerConfig()
        scheduler.num_kv_blocks = blocks
        scheduler.enable_prefix_caching = config.prefix_caching
        if config.max_num_seqs:
            scheduler.max_num_seqs = config.max_num_seqs
        if config.max_num_batched_tokens:
            scheduler.max_num_batched_tokens = config.max_num_batched_tokens
        properties: dict[str, Any] = {
            "INFERENCE_PRECISION_HINT": config.precision,
            "KV_CACHE_PRECISION": _TYPES[config.kv_precision],
        }
        if config.threads:
            properties["INFERENCE_NUM_THREADS"] = config.threads
        log.info("pipeline %s: %s, scheduler %s", model, properties, scheduler.to_string())
        self.pipe = genai.ContinuousBatchingPipeline(str(model), scheduler, "CPU", properties)
        self.defaults = self.pipe.get_config()
        self.config = config
        self.inbox: queue.Queue = queue.Queue()  # (connection, message) from the readers
        self.live: dict[int, tuple[Connection, str, Any]] = {}  # pipeline id -> (client, request id, handle)
        self.by_request: dict[tuple[int, str], int] = {}
        self.ids = itertools.count()
        self.watchers: set[Connection] = set()
        self.scorer = Scorer(config)  # Score, on the clients' reader threads
        self.info = W.Info(
            model=str(model),
            version=genai.get_version(),
            pid=os.getpid(),
            max_model_len=context,
            max_num_seqs=scheduler.max_num_seqs,
            max_num_batched_tokens=scheduler.max_num_batched_tokens,
            block_size=BLOCK_SIZE,
            kv_blocks=blocks,
            dtype={"f32": "float32", "bf16": "bfloat16"}[config.precision],
            enforce_eager=False,
            prefix_caching=config.prefix_caching,
            load_s=time.perf_counter() - started,
            runtime="OpenVINO GenAI",
            refuses=["logit_bias"],
        )

    # -- the engine thread -------------------------------------------------------------------------
    def run(self, stopping: threading.Event) -> None:
        while not stopping.is_set():
            busy = bool(self.live) or self.pipe.has_non_finished_requests()  # a stopped request leaves at a step
            self._take(block=not busy)
            if not self.live and not self.pipe.has_non_finished_requests():
                continue
            started = time.perf_counter()
            try:
                self.pipe.step()
            except Exception as err:
                log.exception("step failed")
                for pid in list(self.live):
                    self._end(pid, W.Failed(id=self.live[pid][1], error=f"{type(err).__name__}: {err}"))
                continue
            seconds = time.perf_counter() - started
            self._read()
            if self.watchers:
                self._stats(seconds)

    def _take(self, *, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            connection, message = item
            if isinstance(message, W.Submit):
                self._submit(connection, message)
            elif isinstance(message, W.Abort):
                self._abort(connection, message.id)
            elif message is None:  # the client left: its requests stop
                for owner, request_id, _ in list(self.live.values()):
                    if owner is connection:
                        self._abort(connection, request_id)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _submit(self, connection: Connection, msg: Any) -> None:
        import numpy as np
        import openvino as ov

        try:
            config = self._generation_config(msg)
            pid = next(self.ids)
            prompt = ov.Tensor(np.asarray([msg.prompt_ids], dtype=np.int64))
            handle = self.pipe.add_request(pid, prompt, config)
        except Exception as err:  # noqa: BLE001 - this request fails alone
            connection.send(W.Failed(id=msg.id, error=f"{type(err).__name__}: {err}"))
            return
        self.live[pid] = (connection, msg.id, handle)
        self.by_request[(id(connection), msg.id)] = pid

    def _generation_config(self, msg: Any) -> Any:
        if msg.logit_bias:
            raise ValueError("OpenVINO GenAI has no logit_bias")
        config = self.pipe.get_config()
        config.max_new_tokens = msg.max_tokens
        config.min_new_tokens = msg.min_tokens
        config.ignore_eos = msg.ignore_eos
        config.repetition_penalty = msg.repetition_penalty
        config.presence_penalty = msg.presence_penalty
        config.frequency_penalty = msg.frequency_penalty
        if msg.stop_token_ids:
            config.stop_token_ids = set(msg.stop_token_ids)
        config.do_sample = msg.temperature > 0
        if config.do_sample:
            config.temperature = msg.temperature
            config.top_p = msg.top_p
            config.top_k = msg.top_k if msg.top_k > 0 else 0
            config.min_p = msg.min_p
            # a request without a seed must not repeat the last one's draw
            config.rng_seed = msg.seed if msg.seed is not None else random.getrandbits(31) + 1
        config.validate()
        return config

    def _abort(self, connection: Connection, request_id: str) -> None:
        pid = self.by_request.get((id(connection), request_id))
        if pid is not None and pid in self.live:
            self.live[pid][2].stop()
            self._end(pid, W.Tokens(id=request_id, tokens=[], finished="abort"))

    def _read(self) -> None:
        import openvino_genai as genai

        for pid, (connection, request_id, handle) in list(self.live.items()):
            tokens: list[int] = []
            reason = None
            while handle.can_read():
                for output in handle.read().values():
                    tokens.extend(int(t) for t in output.generated_ids)
                    if output.finish_reason != genai.GenerationFinishReason.NONE:
                        reason = "length" if output.finish_reason == genai.GenerationFinishReason.LENGTH else "stop"
            status = handle.get_status()
            if status != genai.GenerationStatus.RUNNING and reason is None:
                reason = "stop" if status == genai.GenerationStatus.FINISHED else "abort"
            if reason is not None:
                self._end(pid, W.Tokens(id=request_id, tokens=tokens, finished=reason))
            elif tokens:
                connection.send(W.Tokens(id=request_id, tokens=tokens))

    def _end(self, pid: int, message: Any) -> None:
        connection, request_id, _ = self.live.pop(pid)
        self.by_request.pop((id(connection), request_id), None)
        connection.send(message)

    def _stats(self, seconds: float) -> None:
        """After a step and the reads: the requests still live (those the step scheduled run, the
        others wait); a step's cache usage counts blocks that the next step frees, so none is in
        use once no request is live."""
        metrics = self.pipe.get_metrics()
        running = min(len(self.live), int(metrics.scheduled_requests))
        message = W.Stats(
            running=running,
            waiting=len(self.live) - running,
            kv_usage=float(metrics.cache_usage) / 100.0 if self.live else 0.0,
            seconds=seconds,
        )
        for connection in list(self.watchers):
            connection.send(message)


# -- the socket ------------------------------------------------------------------------------------
class Connection:
    def __init__(self, sock: socket.socket, engine: Engine):
        self.sock, self.engine = sock, engine
        self.lock = threading.Lock()
        self.open = True

    def send(self, message: Any) -> None:
        data = W.encode(message)
        with self.lock:
            if not self.open:
                return
            try:
                self.sock.sendall(data)
            except OSError:
                self.open = False

    def serve(self) -> None:
        """Read this client's messages until it leaves."""
        self.send(self.engine.info)
        try:
            for line in self.sock.makefile("rb"):
                try:
                    message = W.decode(line)
                except (ValueError, TypeError) as err:
                    self.send(W.Failed(id="", error=f"bad message: {err}"))
                    continue
                if isinstance(message, W.Score):
                    self._score(message)
                elif isinstance(message, W.Watch):
                    self.engine.watchers.add(self)
                elif isinstance(message, (W.Submit, W.Abort)):
                    self.engine.inbox.put((self, message))
                else:
                    self.send(W.Failed(id="", error=f"the engine takes Submit, Score, Abort or Watch, not {message}"))
        except OSError:
            pass
        finally:
            self.engine.watchers.discard(self)
            self.engine.inbox.put((self, None))
            with self.lock:
                self.open = False
            self.sock.close()

    def _score(self, message: Any) -> None:
        try:
            targets, top_ids, top_logprobs = self.engine.scorer.score(message.prompt_ids, getattr(message, "top_k", 0))
            self.send(W.Scored(id=message.id, logprobs=targets, top_ids=top_ids, top_logprobs=top_logprobs))
        except Exception as err:  # noqa: BLE001 - the client's call fails, the engine serves on
            self.send(W.Failed(id=message.id, error=f"{type(err).__name__}: {err}"))


class Clients:
    """How many clients are connected, and since when none is."""

    def __init__(self) -> None:
        self.count = 0
        self.idle_since = time.monotonic()
        self.lock = threading.Lock()
        self.ever = False

    def serve(self, connection: Connection) -> None:
        with self.lock:
            self.count += 1
            self.ever = True
        try:
            connection.serve()
        finally:
            with self.lock:
                self.count -= 1
                self.idle_since = time.monotonic()


def serve(socket_path: Path, config: Any) -> None:
    engine = Engine(config)
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    worker = threading.Thread(target=engine.run, args=(stopping,), name="engine", daemon=True)
    worker.start()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = socket_path.with_name(socket_path.name + f".{os.getpid()}")
    listener.bind(str(tmp))
    listener.listen(64)
    listener.settimeout(0.5)
    os.replace(tmp, socket_path)  # appears whole, once the pipeline is ready
    log.info("ready in %.1f s on %s: %s", engine.info.load_s, socket_path, engine.info)
    clients = Clients()
    parent = os.getppid()
    try:
        while not stopping.is_set():
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                sock = None
            if sock is not None:
                sock.settimeout(None)
                threading.Thread(target=clients.serve, args=(Connection(sock, engine),), daemon=True).start()
            with clients.lock:
                idle_for = time.monotonic() - clients.idle_since if clients.count == 0 else 0.0
                ever = clients.ever
            if config.keep_s <= 0 and (os.getppid() != parent or (ever and clients.count == 0)):
                log.info("the last client left (or the process that started this engine is gone): stopping")
                stopping.set()
            elif config.keep_s > 0 and idle_for >= config.keep_s:
                log.info("no client for %.0f s: stopping", config.keep_s)
                stopping.set()
    finally:
        listener.close()
        socket_path.unlink(missing_ok=True)
        worker.join(timeout=10)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="accelab's OpenVINO GenAI engine process")
    parser.add_argument("--socket", required=True, type=Path)
    parser.add_argument("--config", required=True, help="OvEngineConfig as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    serve(args.socket, W.OvEngineConfig.from_json(args.config))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
