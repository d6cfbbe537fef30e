"""One measurement: a (ModelSpec, Plan, Workload) in its own child process -> a Result.

The child follows a recipe, one block per step: process settings and load (apply_plan), the
inputs, the timed scenario under the memory sampler, then the hardware figures (FLOPs, MFU,
roofline). The parent turns the child's outcome into a Result and appends it to the store.
"""

from __future__ import annotations

import logging
import resource
import time
from dataclasses import dataclass
from typing import Any

from accelab.catalog.spec import ModelSpec
from accelab.measure.runner import ChildJob, run_isolated
from accelab.plan.plan import Plan
from accelab.results.result import Result, command_line
from accelab.scenarios.workload import Workload

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchJob:
    spec: ModelSpec
    plan: Plan
    workload: Workload
    device: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchOutput:
    status: str  # "ok" | "unsupported"
    metrics: dict[str, Any]
    notes: list[str]
    reason: str | None = None


def measure_in_child(job: BenchJob) -> BenchOutput:
    """Child entry point (runs in a fresh process)."""
    import torch

    from accelab.plan.apply import apply_plan, resolve_device
    from accelab.plan.runtime import Unsupported, input_device, to_device

    plan, workload, spec = job.plan, job.workload, job.spec
    batch_size = plan.batch_size or workload.batch_size

    # 1. load and apply the plan
    try:
        device = resolve_device(plan, job.device)
        t0 = time.perf_counter()
        runnable = apply_plan(spec, plan, device)
        load_s = time.perf_counter() - t0
    except Unsupported as why:
        return BenchOutput(status="unsupported", metrics={}, notes=[], reason=str(why))
    log.info("loaded %s with plan %s in %.1f s", spec.name, plan.name, load_s)

    with runnable:
        # 2. inputs: real samples (or synthetic of the same shape), on the first layer's device
        batch = _build_batch(runnable, workload, batch_size)
        batch = to_device(batch, input_device(runnable.model, device))
        batch = _prepare_layout(batch, plan)

        # 3. the timed scenario, with memory sampled around it
        from accelab.measure.memory import PeakMemorySampler

        with PeakMemorySampler(device=device) as sampler:
            if workload.scenario == "forward":
                from accelab.scenarios.forward import run_forward

                metrics = run_forward(runnable, batch, workload, batch_size)
            elif workload.scenario == "generate":
                from accelab.scenarios.generate import run_generate

                metrics = run_generate(runnable, batch, workload, batch_size)
            else:
                raise ValueError(f"scenario {workload.scenario!r} is run by `accelab train`, not bench")
        metrics["load_s"] = load_s
        metrics["memory"] = sampler.report.to_dict()
        metrics["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        metrics["peak_memory_mb"] = _peak_memory_mb(metrics, device)
        metrics["threads"] = {"intra_op": torch.get_num_threads(), "inter_op": torch.get_num_interop_threads()}
        metrics["device"] = str(device)
        if runnable.placement:
            metrics["placement"] = runnable.placement

        # 4. against the hardware
        metrics.update(_hardware_figures(runnable, batch, workload, metrics, device))
        return BenchOutput(status="ok", metrics=metrics, notes=list(runnable.notes))


def _build_batch(runnable: Any, workload: Workload, batch_size: int) -> dict[str, Any]:
    from accelab.catalog import inputs

    synthetic = workload.inputs == "synthetic"
    loaded = _LoadedView(runnable)
    if workload.scenario == "generate":
        return inputs.generate_batch(loaded, batch_size, synthetic=synthetic)
    return inputs.forward_batch(
        loaded, batch_size, seq_len=workload.seq_len, image_size=workload.image_size, synthetic=synthetic
    )


@dataclass
class _LoadedView:
    """What the catalog's batch builders read: model, processor and task of a Runnable."""

    runnable: Any

    @property
    def model(self) -> Any:
        return self.runnable.model

    @property
    def processor(self) -> Any:
        return self.runnable.processor

    @property
    def spec(self) -> Any:
        return _TaskOnly(self.runnable.task)


@dataclass
class _TaskOnly:
    task: str
    name: str = ""


def _prepare_layout(batch: dict[str, Any], plan: Plan) -> dict[str, Any]:
    try:
        from accelab.plan.techniques.memory_format import prepare_batch
    except ImportError:  # pragma: no cover - technique module always present
        return batch
    return prepare_batch(batch, plan)


def _peak_memory_mb(metrics: dict[str, Any], device: Any) -> float:
    mem = metrics["memory"]
    if getattr(device, "type", "cpu") == "cuda" and mem.get("gpu_peak_allocated_mb"):
        return float(mem["gpu_peak_allocated_mb"])
    return float(mem.get("peak_rss_mb") or metrics["peak_rss_mb"])


def _hardware_figures(runnable: Any, batch: dict, workload: Workload, metrics: dict, device: Any) -> dict[str, Any]:
    """MFU of a forward (FLOPs per call over measured peak) and, for decoding, the roofline:
    weight bytes read per step over measured memory bandwidth."""
    from accelab.measure.flops import count_flops, decode_roofline, mfu, weight_bytes
    from accelab.measure.hardware import hardware_limits

    figures: dict[str, Any] = {}
    limits = hardware_limits(str(device.type))
    figures["hardware"] = {"peak_flops": limits.fp32_flops, "bandwidth_bytes_per_s": limits.bandwidth_bytes_per_s}
    model_bytes = runnable.weight_bytes or _safe(lambda: weight_bytes(runnable.model))
    figures["weight_bytes"] = model_bytes
    if workload.scenario == "forward":
        flops = _safe(lambda: count_flops(runnable.forward, batch))
        if flops:
            seconds = metrics["latency_ms"]["p50"] / 1000
            figures["flops_per_call"] = flops
            figures["achieved_flops"] = flops / seconds
            figures["mfu"] = mfu(flops, seconds, limits.fp32_flops)
    elif "decode_step_s" in metrics and model_bytes:
        figures["roofline"] = decode_roofline(model_bytes, metrics["decode_step_s"], limits.bandwidth_bytes_per_s)
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
) -> Result:
    """Measure in a child process and return the Result (not stored: see `store`)."""
    from accelab.measure.environment import environment, fingerprint

    effective = workload
    if plan.batch_size and plan.batch_size != workload.batch_size:
        effective = Workload.from_dict({**workload.to_dict(), "batch_size": plan.batch_size})
    job = ChildJob(
        target="accelab.bench.engine:measure_in_child",
        payload=BenchJob(spec=spec, plan=plan, workload=effective, device=device),
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
        workload=effective.to_dict(),
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
    else:
        result.status = outcome.status  # type: ignore[assignment]
        result.reason = outcome.reason
        if outcome.traceback:
            result.metrics = {"traceback": outcome.traceback}
    return result
