"""The measuring child: one (ModelSpec, Plan, Workload) loaded in its own process, answering
the driver's requests (`accelab.benchmark.rounds`): Load, Round as often as asked, Finish.

Its recipe, one block per step: process settings and load (load_runnable), the inputs, the
warm-up, the timed rounds under the memory sampler, then the hardware figures (FLOPs, MFU,
roofline) and the quality outputs. Its metric keys are `accelab.results.contract.FORWARD` and
`GENERATE`.
"""

from __future__ import annotations

import dataclasses
import logging
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from accelab import runtimes  # looked up per call: tests/faults replaces runtimes.load_runnable
from accelab.catalog import inputs
from accelab.catalog.facts import weight_bytes
from accelab.catalog.spec import ModelSpec
from accelab.measure.flops import count_flops, decode_roofline, mfu
from accelab.measure.hardware import hardware_limits
from accelab.measure.memory import PeakMemorySampler, combine_reports
from accelab.measure.stats import summarize
from accelab.plan.apply import resolve_device
from accelab.plan.plan import Plan
from accelab.plan.runtime import Unsupported, input_device, to_device
from accelab.plan.techniques.memory_format import prepare_batch
from accelab.quality.collect import QualityConfig, collect
from accelab.results import contract as K
from accelab.scenarios.forward import ForwardScenario
from accelab.scenarios.workload import RoundSpec, Workload

if TYPE_CHECKING:
    from accelab.measure.hardware import HardwareLimits

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchJob:
    spec: ModelSpec
    plan: Plan
    workload: Workload
    device: str | None = None
    quality: QualityConfig | None = None  # also collect outputs for the quality guard


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchOutput:
    status: Literal["ok", "unsupported"]
    metrics: dict[str, Any]
    notes: list[str]
    reason: str | None = None
    outputs: dict[str, Any] | None = None  # for the quality guard, when asked


@dataclass(frozen=True, kw_only=True, slots=True)
class Load:
    """Load the model, apply the plan, build the inputs and warm up (untimed)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Round:
    """One short timed loop; the driver measures the machine's noise around it."""

    spec: RoundSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class Finish:
    """The figures over the rounds kept (indices), the hardware figures and the quality outputs."""

    kept: tuple[int, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Loaded:
    status: Literal["ok", "unsupported"]
    reason: str | None = None
    load_s: float = 0.0
    warmup_s: float = 0.0  # the untimed calls, compilation included
    worker_pids: tuple[int, ...] = ()  # other processes doing the work (Runnable.worker_pids)


@dataclass(frozen=True, kw_only=True, slots=True)
class RoundDone:
    """What the driver needs of a round; the samples stay in the child until Finish."""

    seconds: float
    calls: int
    rate: float  # items/s (forward) or tokens/s (generate) of this round
    cv: float  # spread of this round's call latencies


class BenchChild:
    """The measuring child's side of a run, one request at a time (see `accelab.measure.session`):
    Load once, Round as often as the driver asks, Finish once. The recipe, one block per step:
    process settings and load (load_runnable), the inputs, the warm-up, the timed rounds under the
    memory sampler, then the hardware figures (FLOPs, MFU, roofline) and the quality outputs."""

    def __init__(self, job: BenchJob) -> None:
        self.job = job
        self.runnable: Any = None
        self.scenario: Any = None
        self.rounds: list[Any] = []
        self.memory: list[Any] = []
        self.load_s = 0.0

    def handle(self, request: Load | Round | Finish) -> Loaded | RoundDone | BenchOutput:
        if isinstance(request, Load):
            return self.load()
        if isinstance(request, Round):
            return self.round(request.spec)
        if isinstance(request, Finish):
            return self.finish(request.kept)
        raise TypeError(f"unknown request {type(request).__name__}")

    def load(self) -> Loaded:
        job = self.job
        # 1. load and apply the plan
        try:
            self.device = resolve_device(job.plan, job.device)
            t0 = time.perf_counter()
            self.runnable = runtimes.load_runnable(job.spec, job.plan, self.device)
            self.load_s = time.perf_counter() - t0
        except Unsupported as why:
            return Loaded(status="unsupported", reason=str(why))
        log.info("loaded %s with plan %s in %.1f s", job.spec.name, job.plan.name, self.load_s)
        self.runnable.__enter__()
        # 2. inputs: real samples (or synthetic of the same shape), on the first layer's device
        batch = _build_batch(self.runnable, job.workload)
        batch = to_device(batch, input_device(self.runnable.model, self.device))
        self.batch = _prepare_layout(batch, job.plan)
        # 3. the warm-up, sampled for memory like the rounds (a compile's peak counts)
        self.scenario = _scenario(self.runnable, self.batch, job.workload)
        with PeakMemorySampler(device=self.device) as sampler:
            warm = self.scenario.warm()
        self.memory.append(sampler.report)
        return Loaded(
            status="ok",
            load_s=self.load_s,
            warmup_s=sum(warm),
            worker_pids=tuple(getattr(self.runnable, "worker_pids", ())),
        )

    def round(self, spec: RoundSpec) -> RoundDone:
        if self.scenario is None:
            raise RuntimeError("Round before a successful Load")
        # 4. one timed round, memory sampled around it
        with PeakMemorySampler(device=self.device) as sampler:
            timed = self.scenario.round(spec)
        self.memory.append(sampler.report)
        self.rounds.append(timed)
        return RoundDone(
            seconds=timed.wall_seconds,
            calls=timed.iterations,
            rate=self.scenario.rate(timed),
            cv=summarize(timed.durations).cv,
        )

    def finish(self, kept: tuple[int, ...]) -> BenchOutput:
        if self.scenario is None or not self.rounds:
            raise RuntimeError("Finish before any timed round")
        runnable, device = self.runnable, self.device
        try:
            rounds = [self.rounds[i] for i in kept] or self.rounds
            metrics = self.scenario.metrics(rounds)
            metrics[K.LOAD_S] = self.load_s
            memory = combine_reports(self.memory)
            metrics[K.MEMORY] = dataclasses.asdict(memory)
            metrics[K.PEAK_RSS_MB] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            metrics[K.PEAK_MEMORY_MB] = _peak_memory_mb(metrics, device)
            metrics[K.THREADS] = {"intra_op": torch.get_num_threads(), "inter_op": torch.get_num_interop_threads()}
            metrics[K.DEVICE] = str(device)
            if runnable.placement:
                metrics[K.PLACEMENT] = runnable.placement
            # 5. against the hardware
            metrics.update(_hardware_figures(runnable, self.batch, self.job.workload, metrics, device))
            # 6. outputs for the quality guard, after timing so they cannot disturb it
            outputs = None
            if self.job.quality is not None:
                outputs = collect(runnable, self.job.quality)
            notes = list(runnable.notes) + [metrics[k] for k in (K.MFU_UNKNOWN, K.ROOFLINE_UNKNOWN) if k in metrics]
            return BenchOutput(status="ok", metrics=metrics, notes=notes, outputs=outputs)
        finally:
            runnable.__exit__(None, None, None)


def measure_in_child(job: BenchJob) -> BenchOutput:
    """One-shot child entry point: load, one timed loop of the whole workload, the figures."""
    child = BenchChild(job)
    loaded = child.load()
    if loaded.status != "ok":
        return BenchOutput(status=loaded.status, metrics={}, notes=[], reason=loaded.reason)
    child.round(RoundSpec.whole(job.workload))
    return child.finish((0,))


def _scenario(runnable: Any, batch: dict[str, Any], workload: Workload) -> Any:
    if workload.scenario == "forward":
        return ForwardScenario(runnable, batch, workload)
    if workload.scenario == "generate":
        from accelab.scenarios.generate import GenerateScenario

        return GenerateScenario(runnable, batch, workload)
    raise ValueError(f"scenario {workload.scenario!r} is run by `accelab train`, not bench")


def _build_batch(runnable: Any, workload: Workload) -> dict[str, Any]:
    synthetic = workload.inputs == "synthetic"
    if workload.scenario == "generate":
        return inputs.generate_batch(runnable.as_loaded(), workload.batch_size, synthetic=synthetic)
    return inputs.forward_batch(
        runnable.as_loaded(),
        workload.batch_size,
        seq_len=workload.seq_len,
        image_size=workload.image_size,
        synthetic=synthetic,
    )


def _prepare_layout(batch: dict[str, Any], plan: Plan) -> dict[str, Any]:
    return prepare_batch(batch, plan)


def _peak_memory_mb(metrics: dict[str, Any], device: Any) -> float:
    mem = metrics[K.MEMORY]
    if getattr(device, "type", "cpu") == "cuda" and mem.get("gpu_peak_allocated_mb"):
        return float(mem["gpu_peak_allocated_mb"])
    return float(mem.get("peak_rss_mb") or metrics[K.PEAK_RSS_MB])


def _hardware_figures(runnable: Any, batch: dict, workload: Workload, metrics: dict, device: Any) -> dict[str, Any]:
    """MFU of a forward (FLOPs per call over the peak of the compute path the plan runs in) and,
    for decoding, the roofline (weight bytes read per step over the memory bandwidth).

    Neither is ever printed above 100%: the peaks and the bandwidth are the best of the kernels
    models run, so a figure above them means they were measured under worse conditions (a
    busy machine). Then they are measured again, once; a figure still above 100% is reported
    as unknown, with the reason, instead of an impossible number."""
    limits = hardware_limits(str(device.type))
    path, peak = limits.peak_for(runnable.plan.precision)
    hardware = {"peak_flops": peak, "compute_path": path, "bandwidth_bytes_per_s": limits.bandwidth_bytes_per_s}
    model_bytes = runnable.weight_bytes or _safe(lambda: weight_bytes(runnable.model))
    figures: dict[str, Any] = {K.HARDWARE: hardware, K.WEIGHT_BYTES: model_bytes}

    def measured_again() -> HardwareLimits:  # for a figure above 100%: the peaks under quieter conditions
        return hardware_limits(str(device.type), refresh=True)

    if workload.scenario == "forward" and runnable.plan.quantization == "none" and peak:
        # (torch's counter does not see torchao's int8 kernels: a quantised plan gets no MFU
        # rather than a figure that counts only its few full-precision layers)
        flops = _safe(lambda: count_flops(runnable.forward, batch))
        if flops:
            seconds = metrics[K.LATENCY_MS]["p50"] / 1000
            figures.update(_mfu_figures(flops, seconds, runnable.plan.precision, peak, measured_again, hardware))
    elif K.DECODE_STEP_S in metrics and model_bytes:
        figures.update(_roofline_figures(model_bytes, metrics[K.DECODE_STEP_S], limits, measured_again, hardware))
    return figures


def _mfu_figures(
    flops: float,
    seconds: float,
    precision: str,
    peak: float,
    measured_again: Callable[[], HardwareLimits],
    hardware: dict[str, Any],
) -> dict[str, Any]:
    """FLOPs per call, FLOP/s and the MFU against the compute path's peak (measured again once,
    into `hardware`, when the MFU comes out above 100%)."""
    figures: dict[str, Any] = {K.FLOPS_PER_CALL: flops, K.ACHIEVED_FLOPS: flops / seconds}
    value = mfu(flops, seconds, peak)
    if value <= 1.0:
        figures[K.MFU] = value
        return figures
    limits = measured_again()
    path, fresh = limits.peak_for(precision)
    hardware["peak_flops"] = fresh
    value = mfu(flops, seconds, fresh) if fresh else value
    if value > 1.0:
        figures[K.MFU_UNKNOWN] = (
            f"MFU unknown: the forward ran at {flops / seconds / 1e9:.1f} GFLOP/s, above the {path} peak "
            f"measured twice here ({(fresh or 0) / 1e9:.1f} GFLOP/s, {limits.kernels.get(path, 'kernel?')}): "
            "a kernel the model runs is faster than those measured, or the FLOP count is off"
        )
    else:
        figures[K.MFU] = value
    return figures


def _roofline_figures(
    model_bytes: float,
    step_s: float,
    limits: HardwareLimits,
    measured_again: Callable[[], HardwareLimits],
    hardware: dict[str, Any],
) -> dict[str, Any]:
    """Decoding's share of the memory-bandwidth bound (the bandwidth measured again once, into
    `hardware`, when the share comes out above 100%)."""
    roof = decode_roofline(model_bytes, step_s, limits.bandwidth_bytes_per_s)
    if roof["fraction"] > 1.0:
        limits = measured_again()
        hardware["bandwidth_bytes_per_s"] = limits.bandwidth_bytes_per_s
        roof = decode_roofline(model_bytes, step_s, limits.bandwidth_bytes_per_s)
    if roof["fraction"] > 1.0:
        return {
            K.ROOFLINE_UNKNOWN: (
                f"roofline unknown: decoding read {roof['achieved_bandwidth'] / 1e9:.1f} GB/s of weights, above the "
                f"bandwidth measured twice here ({limits.bandwidth_bytes_per_s / 1e9:.1f} GB/s, "
                f"{limits.kernels.get('bandwidth', 'kernel?')}): part of the weights stays in cache between steps"
            )
        }
    return {K.ROOFLINE: roof}


def _safe(fn: Any) -> Any:
    """Hardware figures are extras: a model FlopCounterMode cannot trace still gets its timings."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - an extra figure that fails (any error) is skipped, not the run
        log.warning("hardware figure skipped: %s", err)
        return None
