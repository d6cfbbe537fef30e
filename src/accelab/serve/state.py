"""The server's state: the engine once loaded, the worker, readiness, draining and the count
of requests in flight. One per app (kept on `app.state.accelab`)."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
import traceback
from collections.abc import Callable, MutableMapping
from concurrent.futures import Future
from typing import Any, Literal

import torch

from accelab.plan import fit
from accelab.plan.runtime import Unsupported
from accelab.serve import machine_bound
from accelab.serve.config import ServeConfig
from accelab.serve.continuous import ContinuousWorker
from accelab.serve.engines.base import (
    ROUTES_OF_TASK,
    ContinuousHooks,
    CostsSteps,
    StepEngine,
    StepReport,
)
from accelab.serve.engines.interfaces import Engine, GenerationEngine, SchedulesItself, generates
from accelab.serve.errors import ApiError
from accelab.serve.jobs import Executor, GenerationWorker
from accelab.serve.machine_bound import MachineBound
from accelab.serve.metrics import ServeMetrics
from accelab.serve.runner.ragged import takes_weights_over
from accelab.serve.scheduler import SchedulerConfig
from accelab.serve.worker import Worker, WorkerHooks

log = logging.getLogger(__name__)

Status = Literal["loading", "ready", "failed", "draining"]


KV_HEADROOM = 1 << 30  # memory the default KV cache leaves for the steps' activations and the allocator


def _kv_room_tokens(engine: Engine) -> int | None:
    """Tokens of keys and values that half the memory left after loading holds (less KV_HEADROOM),
    for the own engine's torch plans on the CPU; None where that is not this process's memory to
    size. Half: the cache is zeroed at start (every page taken), the machine is often shared, and an
    8B served with all of it beside a test suite was killed by the kernel (14.8 GB, 4.9 GB of it
    cache); the other half stays for whatever else grows."""
    runnable = getattr(engine, "runnable", None)
    if runnable is None or runnable.plan is None or runnable.model is None:
        return None
    plan, model = runnable.plan, runnable.model
    if plan.backend != "torch" or runnable.device.type != "cpu":
        return None
    per_token = fit.kv_bytes_per_token(model.config, fit.kv_dtype(plan))
    if not per_token:
        return None
    # the packed steps hold their own copy of each int8 weight (its operator's layout), made after
    # the cache: an eager text model's steps take the model's weights over as they pack them (held
    # once: one layer's copy at a time is within the headroom); a compiled plan's graphs and a
    # vision-language model's steps hold a second copy, counted out first (an 8B's 7 GB; left in,
    # the server was killed at 23.6 GB)
    packed = (
        0
        if takes_weights_over(model, plan.compile)
        else sum(getattr(getattr(m, "weight", None), "qdata", torch.empty(0)).numel() for m in model.modules())
    )
    return max(0, fit.available_bytes() - KV_HEADROOM - packed) // 2 // per_token


class ServerState:
    def __init__(self, config: ServeConfig, engine_factory: Callable[[], Engine], metrics: ServeMetrics):
        self.config = config
        self.metrics = metrics
        self.created = int(time.time())
        self._engine_factory = engine_factory
        self.engine: Engine | None = None
        self.status: Status = "loading"
        self.load_error: str | None = None
        self.on_load_failure: Callable[[str], None] = lambda reason: None  # the runner stops the server
        self.arriving = 0  # requests received and not yet submitted (parsing, tokenising): event loop only
        self.worker = Worker(config.batch_policy, hooks=self._worker_hooks(), quiet=lambda: self.arriving == 0)
        self.continuous: GenerationWorker | None = None  # generation, once loaded, unless it falls back
        self.kv_cache: dict[str, int] | None = None  # the continuous worker's KV cache: tokens, bytes
        self._in_flight = 0
        self._idle: asyncio.Event | None = None
        self._loader: threading.Thread | None = None

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker, and load + warm up the model in the background: the server listens
        (and answers /livez, and /readyz with 503) while the model loads."""
        self._idle = asyncio.Event()
        self._idle.set()
        self.worker.start()
        self._loader = threading.Thread(target=self._load, name="accelab-model-loader", daemon=True)
        self._loader.start()

    def _load(self) -> None:
        try:
            started = time.perf_counter()
            engine = self._engine_factory()
            if hasattr(engine, "image_policy"):  # the engines that take images fetch under the server's guards
                engine.image_policy = self.config.image_policy()
            log.info("model %s loaded in %.1f s; warming up", self.config.model_name, time.perf_counter() - started)
            # a step engine's start-up check runs (and compiles) its steps: the model's own generate,
            # which a compiling plan would compile for nothing, warms up only for the static worker
            self.continuous = self._start_continuous(engine)
            if self.continuous is None:
                engine.warmup()
            _freeze_loaded_objects()
            self.engine = engine
            if self.status == "loading":
                self.status = "ready"
            self.metrics.ready.set(1)
            self.metrics.batch_limit.set(self.worker.batch_limit)
            self.metrics.info.labels(
                model=self.config.model_name, plan=self.config.plan_name, device=engine.device
            ).set(1)
            log.info("ready: %s (%s) after %.1f s", self.config.model_name, engine.task, time.perf_counter() - started)
        except Exception as err:  # noqa: BLE001 - reported on /readyz, in the log, and the server stops
            self.load_error = f"{type(err).__name__}: {err}"
            self.status = "failed"
            log.error("loading %s failed:\n%s", self.config.model_name, traceback.format_exc())
            self.on_load_failure(self.load_error)

    def _start_continuous(self, engine: Engine) -> GenerationWorker | None:
        """The generation worker the engine's serve path names (`Engine.worker`), else None (the
        batch worker runs its jobs); the log says which and why."""
        if not generates(engine):
            return None
        name = self.config.model_name
        if engine.worker == "batches":
            log.info(
                "generation: per-batch worker for %s (its runtime has no step engine): one generate call per batch",
                name,
            )
            return None
        if engine.worker == "engine":  # vLLM, OpenVINO GenAI
            if not isinstance(engine, SchedulesItself):
                raise TypeError(f"{type(engine).__name__} names the engine's own worker but brings none")
            engine.warmup()  # through the engine's own client, before its worker shares it
            return self._start_engine_process_worker(engine)
        if self.config.scheduler == "static":
            log.info("generation: per-batch scheduler (--scheduler static): one generate call per batch")
            return None
        limits = self.config.scheduler_config(room_tokens=_kv_room_tokens(engine))
        try:
            stepper = engine.step_engine(limits)
        except Unsupported as reason:
            log.warning("continuous batching is off for %s: %s; it falls back to the per-batch scheduler", name, reason)
            return None
        return self._start_continuous_worker(engine, stepper, limits)

    def _start_engine_process_worker(self, engine: SchedulesItself) -> GenerationWorker:
        own = engine.continuous_worker(self.config, self._continuous_hooks())
        own.start()
        self.metrics.kv_blocks.labels(state="free").set(own.kv_blocks)
        self.metrics.kv_blocks.labels(state="used").set(0)
        log.info(
            "continuous batching: the engine's own scheduler (up to %d sequences, KV cache of %d tokens)",
            own.batch_limit,
            own.kv_tokens,
        )
        return own

    def _start_continuous_worker(
        self, engine: GenerationEngine, stepper: StepEngine, limits: SchedulerConfig
    ) -> GenerationWorker:
        bound = None
        if isinstance(stepper, CostsSteps):
            bound = machine_bound.for_device(engine.device, stepper.precision)
            if bound is not None:
                self.metrics.machine_bandwidth.set(bound.bandwidth)
                self.metrics.machine_peak.set(bound.peak_flops)
        worker = ContinuousWorker(
            stepper,
            limits,
            decode=engine.decode,
            eos_ids=engine.eos_ids,
            hooks=self._continuous_hooks(bound),
            encoder_share=self.config.encoder_share,
            encoder_batch=self.config.encoder_batch,
        )
        worker.start()
        self.metrics.kv_blocks.labels(state="free").set(limits.kv_blocks)
        self.metrics.kv_blocks.labels(state="used").set(0)
        self.metrics.kv_bytes.labels(state="free").set(limits.kv_tokens * stepper.kv_bytes_per_token)
        self.metrics.kv_bytes.labels(state="used").set(0)
        self.metrics.kv_cached_blocks.set(0)
        self.kv_cache = {"tokens": limits.kv_tokens, "bytes": limits.kv_tokens * stepper.kv_bytes_per_token}
        asked = self.config.default_kv_tokens
        sized = (
            "--kv-cache-tokens"
            if self.config.kv_cache_tokens
            else f"what the memory left after the weights holds (of {asked} asked)"
            if limits.kv_tokens < asked
            else f"2048 for each of {limits.max_running} sequences"
        )
        log.info(
            "continuous batching: %s; up to %d sequences, %d tokens per step, KV cache of %d tokens (%d blocks "
            "of %d, %.0f MB at most; sized by %s)",
            stepper.name,
            limits.max_running,
            limits.max_step_tokens,
            limits.kv_tokens,
            limits.kv_blocks,
            limits.block_size,
            limits.kv_tokens * stepper.kv_bytes_per_token / 1e6,
            sized,
        )
        return worker

    def image_preparer(self) -> Callable[[Callable[[], Any]], Future[Any]] | None:
        """Where a chat's images are decoded and processed: on the continuous worker's thread
        between its steps when it encodes the images itself (`WorkerThread.between_steps`), else
        None (a thread of their own)."""
        worker = self.continuous
        if isinstance(worker, ContinuousWorker) and worker.encodes_images:
            return worker.between_steps
        return None

    def executor(self, key: str) -> Executor:
        """Who runs a job of `key`: the continuous worker for text generation (with images, for a
        vision-language model's), when there is one."""
        if self.continuous is not None and key in ("generate", "generate:vision"):
            return self.continuous
        return self.worker

    def stop(self, timeout_s: float) -> None:
        if self.continuous is not None:
            if not self.continuous.stop(timeout_s=timeout_s):
                log.warning("the continuous worker was still busy after %.1f s; leaving it", timeout_s)
            else:
                self.continuous.engine.close()  # before the model it runs on
        if not self.worker.stop(timeout_s=timeout_s):
            log.warning("the model worker was still busy after %.1f s; leaving it", timeout_s)
        if self.engine is not None:
            self.engine.close()

    def threads_alive(self) -> bool:
        """The model loader or a worker still runs (a call into torch that did not finish)."""
        continuous = self.continuous is not None and self.continuous.alive
        return bool(self._loader and self._loader.is_alive()) or self.worker.alive or continuous

    def begin_drain(self) -> None:
        self.status = "draining"
        self.metrics.ready.set(0)

    async def wait_idle(self, timeout_s: float) -> bool:
        assert self._idle is not None, "start() first"
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    # -- per request ----------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return self._in_flight

    def enter(self) -> None:
        self._in_flight += 1
        self.metrics.in_flight.set(self._in_flight)
        if self._idle is not None:
            self._idle.clear()

    def arrive(self, scope: MutableMapping[str, Any]) -> None:
        """An API request came in; it counts as on its way to a queue until `submitted`."""
        self.arriving += 1
        scope.setdefault("state", {})["arriving"] = True

    def submitted(self, scope: MutableMapping[str, Any]) -> None:
        """The request reached a queue (or failed before): it is no longer on its way."""
        state = scope.get("state", {})
        if state.pop("arriving", False):
            self.arriving -= 1

    def leave(self) -> None:
        self._in_flight -= 1
        self.metrics.in_flight.set(self._in_flight)
        if self._in_flight == 0 and self._idle is not None:
            self._idle.set()

    def require(self, route: str, model: str | None) -> Any:
        """The engine, when it is ready and serves `route` and `model`; else the right refusal."""
        if self.status == "draining":
            raise ApiError(
                503,
                "the server is shutting down; send the request to another replica",
                kind="shutting_down",
                headers={"Retry-After": "1", "Connection": "close"},
            )
        if self.engine is None or self.status != "ready":
            reason = f"loading failed: {self.load_error}" if self.load_error else "the model is loading"
            raise ApiError(
                503, f"{reason}; /readyz turns 200 when it is ready", kind="not_ready", headers={"Retry-After": "5"}
            )
        if model is not None and model != self.config.model_name:
            raise ApiError(
                404,
                f"model {model!r} is not served here; this server serves {self.config.model_name!r} (see /v1/models)",
                param="model",
            )
        if route not in ROUTES_OF_TASK[self.engine.task]:
            served = ", ".join(sorted(ROUTES_OF_TASK[self.engine.task]))
            raise ApiError(
                400,
                f"{self.config.model_name} is a {self.engine.task} model: it serves {served}, not "
                f"{route}; serve a model of another task for {route}",
            )
        return self.engine

    def require_generation(self, route: str, model: str | None) -> GenerationEngine:
        """`require` for the generation routes: the engine generates (ROUTES_OF_TASK says so)."""
        engine = self.require(route, model)
        assert generates(engine), f"{engine.task} engines do not serve {route}"
        return engine

    def _worker_hooks(self) -> WorkerHooks:
        m = self.metrics

        def on_batch(units: int, seconds: float) -> None:
            m.batch_size.observe(units)
            m.batch_time.observe(seconds)

        return WorkerHooks(
            on_batch=on_batch,
            on_retry=lambda reason: m.retries.labels(reason=reason).inc(),
            on_depth=m.queue_depth.set,
            on_limit=m.batch_limit.set,
        )

    def _continuous_hooks(self, bound: MachineBound | None = None) -> ContinuousHooks:
        m = self.metrics
        kv_used, kv_free = m.kv_blocks.labels(state="used"), m.kv_blocks.labels(state="free")
        bytes_used, bytes_free = m.kv_bytes.labels(state="used"), m.kv_bytes.labels(state="free")

        def on_step(report: StepReport) -> None:  # once per decoding step: keep it cheap
            m.running.set(report.running)
            m.waiting.set(report.waiting)
            m.queue_depth.set(report.waiting)
            kv_used.set(report.kv_used)
            kv_free.set(report.kv_free)
            if report.kv_block_bytes:
                bytes_used.set(report.kv_used * report.kv_block_bytes)
                bytes_free.set(report.kv_free * report.kv_block_bytes)
            m.kv_cached_blocks.set(report.kv_cached)
            if report.preempted:
                m.preemptions.inc(report.preempted)
                m.preempted_tokens.inc(report.preempted_tokens)
            if report.batch:
                m.batch_size.observe(report.batch)
            m.token_rate.add(report.sampled)
            if report.reused_tokens:
                m.prefix_tokens.inc(report.reused_tokens)
            if report.images is not None:
                m.images_encoded.inc(report.images.encoded)
                m.image_cache_hits.inc(report.images.hits)
                m.image_encode_time.inc(report.images.seconds)
            m.batch_time.observe(report.seconds)
            if bound is not None and report.cost is not None:
                m.step_fraction.observe(bound.fraction(report.cost, report.seconds))

        return ContinuousHooks(
            on_step=on_step, on_token_gap=m.itl.observe, on_retry=lambda reason: m.retries.labels(reason=reason).inc()
        )


def _freeze_loaded_objects() -> None:
    """Move everything alive after loading (the model, torch, transformers: ~450k objects for
    MiniLM) out of the garbage collector's reach. Otherwise every full collection walks them
    all, and the server stalls: under 32 closed-loop users a whole batch waited ~250 ms every
    few seconds (MiniLM embeddings, 1 thread: p99 380 ms at p50 140 ms; frozen, with the
    thresholds below: p99 165-180 ms, and ~5% more requests/s). Later objects are collected as
    usual."""
    gc.collect()
    gc.freeze()
    # and collect the young generations less often: a serving loop makes many short-lived
    # objects, few cycles; a full collection then comes every ~5e8 allocations, not ~7e5
    gc.set_threshold(100_000, 50, 100)
    log.info(
        "froze %d objects of the loaded model and libraries (no garbage-collector walks over them)",
        gc.get_freeze_count(),
    )
