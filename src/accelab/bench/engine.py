"""One measurement: a (ModelSpec, Plan, Workload) in its own child process -> a Result.

The child follows a recipe, one block per step: process settings and load (load_runnable), the
inputs, the timed scenario under the memory sampler, then the hardware figures (FLOPs, MFU,
roofline). The parent turns the child's outcome into a Result and appends it to the store.
Its metric keys are `accelab.results.contract.FORWARD` and `GENERATE`.
"""

from __future__ import annotations

import dataclasses
import logging
import resource
import time
from dataclasses import dataclass
from typing import Any

from accelab.catalog.spec import ModelSpec
from accelab.measure.runner import ChildJob, run_isolated
from accelab.plan.plan import Plan
from accelab.quality.collect import QualityConfig
from accelab.results import contract as K
from accelab.results.result import Result, command_line
from accelab.scenarios.workload import Workload

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
    status: str  # "ok" | "unsupported"
    metrics: dict[str, Any]
    notes: list[str]
    reason: str | None = None
    outputs: dict[str, Any] | None = None  # for the quality guard, when asked


def measure_in_child(job: BenchJob) -> BenchOutput:
    """Child entry point (runs in a fresh process)."""
    import torch

    from accelab.plan.apply import resolve_device
    from accelab.runtimes import load_runnable
    from accelab.plan.runtime import Unsupported, input_device, to_device

    plan, workload, spec = job.plan, job.workload, job.spec

    # 1. load and apply the plan
    try:
        device = resolve_device(plan, job.device)
        t0 = time.perf_counter()
        runnable = load_runnable(spec, plan, device)
        load_s = time.perf_counter() - t0
    except Unsupported as why:
        return BenchOutput(status="unsupported", metrics={}, notes=[], reason=str(why))
    log.info("loaded %s with plan %s in %.1f s", spec.name, plan.name, load_s)

    with runnable:
        # 2. inputs: real samples (or synthetic of the same shape), on the first layer's device
        batch = _build_batch(runnable, workload)
        batch = to_device(batch, input_device(runnable.model, device))
        batch = _prepare_layout(batch, plan)

        # 3. the timed scenario, with memory sampled around it
        from accelab.measure.memory import PeakMemorySampler

        with PeakMemorySampler(device=device) as sampler:
            if workload.scenario == "forward":
                from accelab.scenarios.forward import run_forward

                metrics = run_forward(runnable, batch, workload)
            elif workload.scenario == "generate":
                from accelab.scenarios.generate import run_generate

                metrics = run_generate(runnable, batch, workload)
            else:
                raise ValueError(f"scenario {workload.scenario!r} is run by `accelab train`, not bench")
        metrics[K.LOAD_S] = load_s
        metrics[K.MEMORY] = dataclasses.asdict(sampler.report)
        metrics[K.PEAK_RSS_MB] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        metrics[K.PEAK_MEMORY_MB] = _peak_memory_mb(metrics, device)
        metrics[K.THREADS] = {"intra_op": torch.get_num_threads(), "inter_op": torch.get_num_interop_threads()}
        metrics[K.DEVICE] = str(device)
        if runnable.placement:
            metrics[K.PLACEMENT] = runnable.placement

        # 4. against the hardware
        metrics.update(_hardware_figures(runnable, batch, workload, metrics, device))

        # 5. outputs for the quality guard, after timing so they cannot disturb it
        outputs = None
        if job.quality is not None:
            from accelab.quality.collect import collect

            outputs = collect(runnable, job.quality)
        notes = list(runnable.notes) + [metrics[k] for k in (K.MFU_UNKNOWN, K.ROOFLINE_UNKNOWN) if k in metrics]
        return BenchOutput(status="ok", metrics=metrics, notes=notes, outputs=outputs)


def _build_batch(runnable: Any, workload: Workload) -> dict[str, Any]:
    from accelab.catalog import inputs

    synthetic = workload.inputs == "synthetic"
    if workload.scenario == "generate":
        return inputs.generate_batch(runnable.as_loaded(), workload.batch_size, synthetic=synthetic)
    return inputs.forward_batch(
        runnable.as_loaded(), workload.batch_size, seq_len=workload.seq_len, image_size=workload.image_size, synthetic=synthetic
    )


def _prepare_layout(batch: dict[str, Any], plan: Plan) -> dict[str, Any]:
    try:
        from accelab.plan.techniques.memory_format import prepare_batch
    except ImportError:  # pragma: no cover - technique module always present
        return batch
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
    from accelab.catalog.facts import weight_bytes
    from accelab.measure.flops import count_flops, decode_roofline, mfu
    from accelab.measure.hardware import hardware_limits

    figures: dict[str, Any] = {}
    limits = hardware_limits(str(device.type))
    path, peak = limits.peak_for(runnable.plan.precision)
    figures[K.HARDWARE] = {"peak_flops": peak, "compute_path": path,
                           "bandwidth_bytes_per_s": limits.bandwidth_bytes_per_s}
    model_bytes = runnable.weight_bytes or _safe(lambda: weight_bytes(runnable.model))
    figures[K.WEIGHT_BYTES] = model_bytes
    if workload.scenario == "forward" and runnable.plan.quantization == "none" and peak:
        # (torch's counter does not see torchao's int8 kernels: a quantised plan gets no MFU
        # rather than a figure that counts only its few full-precision layers)
        flops = _safe(lambda: count_flops(runnable.forward, batch))
        if flops:
            seconds = metrics[K.LATENCY_MS]["p50"] / 1000
            figures[K.FLOPS_PER_CALL] = flops
            figures[K.ACHIEVED_FLOPS] = flops / seconds
            value = mfu(flops, seconds, peak)
            if value > 1.0:
                limits = hardware_limits(str(device.type), refresh=True)
                path, peak = limits.peak_for(runnable.plan.precision)
                figures[K.HARDWARE]["peak_flops"] = peak
                value = mfu(flops, seconds, peak) if peak else value
            if value > 1.0:
                figures[K.MFU_UNKNOWN] = (
                    f"MFU unknown: the forward ran at {flops / seconds / 1e9:.1f} GFLOP/s, above the {path} peak measured "
                    f"twice here ({(peak or 0) / 1e9:.1f} GFLOP/s, {limits.kernels.get(path, 'kernel?')}): a kernel "
                    "the model runs is faster than those measured, or the FLOP count is off"
                )
            else:
                figures[K.MFU] = value
    elif K.DECODE_STEP_S in metrics and model_bytes:
        roof = decode_roofline(model_bytes, metrics[K.DECODE_STEP_S], limits.bandwidth_bytes_per_s)
        if roof["fraction"] > 1.0:
            limits = hardware_limits(str(device.type), refresh=True)
            figures[K.HARDWARE]["bandwidth_bytes_per_s"] = limits.bandwidth_bytes_per_s
            roof = decode_roofline(model_bytes, metrics[K.DECODE_STEP_S], limits.bandwidth_bytes_per_s)
        if roof["fraction"] > 1.0:
            figures[K.ROOFLINE_UNKNOWN] = (
                f"roofline unknown: decoding read {roof['achieved_bandwidth'] / 1e9:.1f} GB/s of weights, above the "
                f"bandwidth measured twice here ({limits.bandwidth_bytes_per_s / 1e9:.1f} GB/s, "
                f"{limits.kernels.get('bandwidth', 'kernel?')}): part of the weights stays in cache between steps"
            )
        else:
            figures[K.ROOFLINE] = roof
    return figures


def _safe(fn: Any) -> Any:
    """Hardware figures are extras: a model FlopCounterMode cannot trace still gets its timings."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001
        log.warning("hardware figure skipped: %s", err)
        return None


# -- parent side ------------------------------------------------------------------------------
def bench(
    spec: ModelSpec,
    plan: Plan,
    workload: Workload,
    *,
    device: str | None = None,
    timeout_s: float = 1800.0,
    kind: str = "bench",
    tag: str | None = None,
    group_id: str | None = None,
    env: dict[str, str] | None = None,
    quality: QualityConfig | None = None,
    tolerance: str = "balanced",
) -> Result:
    """Measure in a child process and return the Result (not stored: see `Store.add`).

    `workload.batch_size` is the run's batch size as the caller resolved it (`resolve_batch_size`);
    the plan's batch_size is not read here. With `quality`, the same child also collects outputs
    on the real inputs and the Result's `quality` holds the verdict against the fp32 eager
    reference (computed once, cached)."""
    from accelab.measure.environment import environment, fingerprint

    job = ChildJob(
        target="accelab.bench.engine:measure_in_child",
        payload=BenchJob(spec=spec, plan=plan, workload=workload, device=device, quality=quality),
        timeout_s=timeout_s,
        env=env or {},
    )
    outcome = run_isolated(job)
    machine = environment()
    result = Result(
        kind=kind,
        status="error",
        model=spec.to_dict(),
        plan=plan.to_dict(),
        workload=workload.to_dict(),
        environment=machine,
        fingerprint=fingerprint(machine),
        command=command_line(),
        tag=tag,
        group_id=group_id,
    )
    if outcome.ok:
        output: BenchOutput = outcome.value
        result.status = output.status  # type: ignore[assignment]
        result.metrics, result.notes, result.reason = output.metrics, output.notes, output.reason
        if quality is not None and output.outputs is not None:
            from accelab.quality.verify import judge_outputs, reference_outputs

            reference = reference_outputs(spec, quality, device=device, timeout_s=timeout_s)
            result.quality = judge_outputs(spec.task, reference, output.outputs, tolerance)
    else:
        result.status = outcome.status  # type: ignore[assignment]
        result.reason = outcome.reason
        if outcome.traceback:
            result.metrics = {K.TRACEBACK: outcome.traceback}
    return result
