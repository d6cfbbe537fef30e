"""accelab's vLLM engine process: vLLM's AsyncLLM (the engine `vllm serve` runs) behind a Unix
socket, in the vLLM venv.

    .venv-vllm/bin/python -P src/accelab/backends/vllm_engine.py --socket PATH --config JSON

accelab (`accelab.backends.vllm_launch`) starts it and talks `engine_wire` messages to it: token
ids in, token ids out, one JSON line each. vLLM schedules (continuous batching, chunked prefill,
its paged KV cache); accelab keeps its own tokenizer, stop rules, routes, limits and metrics.

The socket appears only once the engine is ready, so a client that connects is served at once.
Any number of clients may connect (a bench child, then the next one): the engine outlives them by
`keep_s` seconds, so the fresh child process of each measurement does not pay vLLM's start (minutes
on CPU) again. With keep_s 0 it exits when its last client leaves (a server that owns it).

Standard library and vllm only (no accelab: it is not installed in the vLLM venv); `-P` keeps this
directory off sys.path, so the backend modules here never shadow packages of the same name.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("accelab.vllm_engine")


def _load_wire() -> Any:
    """accelab's engine_wire, by file path (accelab itself is not importable in the vLLM venv)."""
    spec = importlib.util.spec_from_file_location("accelab_engine_wire", Path(__file__).with_name("engine_wire.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while they are built
    spec.loader.exec_module(module)
    return module


W = _load_wire()
MAX_LOGPROBS = 20  # vLLM's default max_logprobs: a Score asking for more gets this many per position


# -- the engine ----------------------------------------------------------------------------------
def build_engine(config: Any, stats: Any) -> Any:
    """vLLM's AsyncLLM for `config`; its only stat logger is `stats` (no console or Prometheus
    logging of its own: accelab's server has the /metrics)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args: dict[str, Any] = {
        "model": config.model,
        "dtype": config.dtype,
        "enforce_eager": config.enforce_eager,
        "enable_prefix_caching": config.prefix_caching,
        "disable_log_stats": True,
    }
    optional = {
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "block_size": config.block_size,
        "max_model_len": config.max_model_len,
        "kv_cache_memory_bytes": config.kv_cache_bytes,
    }
    args.update({k: v for k, v in optional.items() if v is not None})  # the platform (CPU, CUDA) is vLLM's pick
    log.info("vLLM engine args: %s", args)
    return AsyncLLM.from_engine_args(AsyncEngineArgs(**args), stat_loggers=[stats])


class Audience(Protocol):
    """Who hears the engine's step figures: the server's watching clients (`_Late` until it exists)."""

    @property
    def watchers(self) -> set[Connection]: ...

    def broadcast(self, message: Any) -> None: ...


def stat_logger(server: Audience) -> Any:
    """A vLLM stat logger class that forwards each step's scheduler figures to watching clients."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class Forward(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0):
            self.engine_index = engine_index

        def record(
            self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
        ) -> None:
            if scheduler_stats is None or not server.watchers:
                return
            server.broadcast(
                W.Stats(
                    running=scheduler_stats.num_running_reqs,
                    waiting=scheduler_stats.num_waiting_reqs,
                    kv_usage=float(scheduler_stats.kv_cache_usage),
                    preempted=iteration_stats.num_preempted_reqs if iteration_stats is not None else 0,
                    prefix_hit_tokens=scheduler_stats.prefix_cache_stats.hits,
                )
            )

        def log_engine_initialized(self) -> None:
            pass

    return Forward


def engine_info(engine: Any, config: Any, load_s: float) -> Any:
    import vllm

    vc = engine.vllm_config
    return W.Info(
        model=config.model,
        version=vllm.__version__,
        pid=os.getpid(),
        max_model_len=vc.model_config.max_model_len,
        max_num_seqs=vc.scheduler_config.max_num_seqs,
        max_num_batched_tokens=vc.scheduler_config.max_num_batched_tokens,
        block_size=vc.cache_config.block_size,
        kv_blocks=int(vc.cache_config.num_gpu_blocks or 0),
        dtype=str(vc.model_config.dtype).removeprefix("torch."),
        enforce_eager=bool(vc.model_config.enforce_eager),
        prefix_caching=bool(vc.cache_config.enable_prefix_caching),
        load_s=load_s,
    )


# -- the socket ------------------------------------------------------------------------------------
class Connection:
    """One client: its requests run as tasks; when it leaves, they are aborted."""

    def __init__(self, server: EngineServer, writer: asyncio.StreamWriter, number: int):
        self.server, self.writer, self.number = server, writer, number
        self.tasks: dict[str, asyncio.Task] = {}

    def send(self, message: Any) -> None:
        if not self.writer.is_closing():
            self.writer.write(W.encode(message))

    def dispatch(self, message: Any) -> None:
        if isinstance(message, W.Submit):
            self._start(message.id, self.generate(message))
        elif isinstance(message, W.Score):
            self._start(message.id, self.score(message))
        elif isinstance(message, W.Abort):
            task = self.tasks.get(message.id)
            if task is not None:
                task.cancel()  # vLLM's generate aborts the request when its consumer is cancelled
        elif isinstance(message, W.Watch):
            self.server.watchers.add(self)
        else:
            raise ValueError(f"the engine takes Submit, Score, Abort or Watch, not {type(message).__name__}")

    def _start(self, request_id: str, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self.tasks[request_id] = task
        task.add_done_callback(lambda _: self.tasks.pop(request_id, None))

    async def generate(self, msg: Any) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=msg.max_tokens,
            min_tokens=msg.min_tokens,
            temperature=msg.temperature,
            top_p=msg.top_p,
            seed=msg.seed,
            ignore_eos=msg.ignore_eos,
            top_k=msg.top_k,
            min_p=msg.min_p,
            repetition_penalty=msg.repetition_penalty,
            presence_penalty=msg.presence_penalty,
            frequency_penalty=msg.frequency_penalty,
            stop_token_ids=list(msg.stop_token_ids) or None,
            logit_bias={int(t): float(b) for t, b in msg.logit_bias} or None,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        try:
            stream = self.server.engine.generate(
                TokensPrompt(prompt_token_ids=msg.prompt_ids), params, f"{self.number}-{msg.id}"
            )
            async for out in stream:
                piece = out.outputs[0]
                self.send(
                    W.Tokens(
                        id=msg.id,
                        tokens=list(piece.token_ids),
                        finished=(piece.finish_reason or "stop") if out.finished else None,
                    )
                )
        except asyncio.CancelledError:
            self.send(W.Tokens(id=msg.id, tokens=[], finished="abort"))
        except Exception as err:  # noqa: BLE001 - this request fails alone
            log.warning("request %s failed: %r", msg.id, err)
            self.send(W.Failed(id=msg.id, error=f"{type(err).__name__}: {err}"))

    async def score(self, msg: Any) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        top_k = min(getattr(msg, "top_k", 0), MAX_LOGPROBS)
        params = SamplingParams(
            max_tokens=1, prompt_logprobs=top_k, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY
        )
        try:
            final = None
            async for out in self.server.engine.generate(
                TokensPrompt(prompt_token_ids=msg.prompt_ids), params, f"{self.number}-{msg.id}"
            ):
                final = out
            rows = (final.prompt_logprobs or [])[1:] if final is not None else []
            # each row holds the prompt's own token and the top_k most likely (each with its rank)
            values = [row[token].logprob for token, row in zip(msg.prompt_ids[1:], rows)]
            top = [sorted((lp.rank, t, lp.logprob) for t, lp in row.items() if lp.rank <= top_k) for row in rows]
            self.send(
                W.Scored(
                    id=msg.id,
                    logprobs=values,
                    top_ids=[[t for _, t, _ in r] for r in top] if top_k else [],
                    top_logprobs=[[lp for _, _, lp in r] for r in top] if top_k else [],
                )
            )
        except Exception as err:  # noqa: BLE001 - the client's call fails, the engine serves on
            self.send(W.Failed(id=msg.id, error=f"{type(err).__name__}: {err}"))

    def close(self) -> None:
        self.server.watchers.discard(self)
        for task in list(self.tasks.values()):
            task.cancel()


class EngineServer:
    def __init__(self, engine: Any, info: Any, keep_s: float):
        self.engine, self.info, self.keep_s = engine, info, keep_s
        self.watchers: set[Connection] = set()
        self.clients = 0
        self.served = 0
        self.idle_since = time.monotonic()
        self.stopping = asyncio.Event()

    def broadcast(self, message: Any) -> None:
        for connection in list(self.watchers):
            connection.send(message)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.clients += 1
        self.served += 1
        connection = Connection(self, writer, self.served)
        connection.send(self.info)
        try:
            while line := await reader.readline():
                try:
                    connection.dispatch(W.decode(line))
                except (ValueError, TypeError) as err:
                    connection.send(W.Failed(id="", error=f"bad message: {err}"))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            connection.close()
            writer.close()
            self.clients -= 1
            self.idle_since = time.monotonic()
            if self.clients == 0 and self.keep_s <= 0:
                self.stopping.set()

    async def watch_idle(self) -> None:
        parent = os.getppid()
        while not self.stopping.is_set():
            await asyncio.sleep(min(5.0, max(self.keep_s, 0.5)))
            if self.keep_s <= 0 and os.getppid() != parent:  # its server is gone (even before connecting)
                log.info("the process that started this engine is gone: stopping")
                self.stopping.set()
            if self.clients == 0 and self.keep_s > 0 and time.monotonic() - self.idle_since >= self.keep_s:
                log.info("no client for %.0f s: stopping", self.keep_s)
                self.stopping.set()


async def serve(socket_path: Path, config: Any) -> None:
    started = time.perf_counter()
    holder: list[EngineServer] = []
    stats = stat_logger(_Late(holder))
    engine = build_engine(config, stats)
    info = engine_info(engine, config, time.perf_counter() - started)
    server = EngineServer(engine, info, config.keep_s)
    holder.append(server)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.stopping.set)
    tmp = socket_path.with_name(socket_path.name + f".{os.getpid()}")
    listener = await asyncio.start_unix_server(server.handle, path=str(tmp))
    os.replace(tmp, socket_path)  # appears whole, once the engine is ready
    log.info("ready in %.1f s on %s: %s", info.load_s, socket_path, info)
    idle = loop.create_task(server.watch_idle())
    try:
        await server.stopping.wait()
    finally:
        idle.cancel()
        listener.close()
        socket_path.unlink(missing_ok=True)
        engine.shutdown()


class _Late:
    """The server, once it exists (the stat logger is made before the engine, the server after)."""

    def __init__(self, holder: list[EngineServer]):
        self._holder = holder

    @property
    def watchers(self) -> set[Connection]:
        return self._holder[0].watchers if self._holder else set()

    def broadcast(self, message: Any) -> None:
        if self._holder:
            self._holder[0].broadcast(message)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="accelab's vLLM engine process")
    parser.add_argument("--socket", required=True, type=Path)
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    asyncio.run(serve(args.socket, W.EngineConfig.from_json(args.config)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
