"""`accelab verify`: a plan's outputs against the fp32 eager reference, each in its own process.

The reference outputs are cached per (model files, task, quality config, accelab version, the
evaluation text), so a compare of five plans, and every later verify, runs the reference once.
For generation the cache holds the reference's top-k log-probabilities per scored position of
the evaluation text's windows (`quality.windows`), never its full logits.
"""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from accelab import runtimes  # looked up per call: tests/faults replaces runtimes.load_runnable
from accelab.catalog import inputs
from accelab.catalog.custom import files_of
from accelab.catalog.facts import GENERATE_TASKS
from accelab.catalog.spec import ModelSpec
from accelab.measure.environment import environment, fingerprint
from accelab.measure.runner import ChildJob, run_isolated
from accelab.paths import cache_dir
from accelab.plan.apply import resolve_device
from accelab.plan.plan import Plan
from accelab.plan.runtime import Unsupported
from accelab.plan.techniques import attention
from accelab.quality.collect import QualityConfig, collect
from accelab.quality.metrics import compare
from accelab.quality.verdict import SOURCES, judge
from accelab.results.result import Result, command_line
from accelab.version import __version__

log = logging.getLogger(__name__)

REFERENCE_PLAN = Plan(name="reference-fp32-eager", attention="eager")
FORMAT = 2  # of the cached outputs: 2 holds the windows' top-k log-probabilities, not full logits


def reference_plan(spec: ModelSpec) -> Plan:
    """fp32 with eager attention; a model without attention layers (a ResNet, a ConvNeXt) keeps
    its default, which is the same computation (asking it for eager attention is refused)."""
    try:
        attention.check(REFERENCE_PLAN, spec, torch.device("cpu"))
    except Unsupported:
        return REFERENCE_PLAN.with_changes(attention="default")
    return REFERENCE_PLAN


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectJob:
    spec: ModelSpec
    plan: Plan
    config: QualityConfig
    device: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectOutput:
    status: Literal["ok", "unsupported"]
    outputs: dict[str, Any] | None = None
    reason: str | None = None
    notes: tuple[str, ...] = ()


def collect_in_child(job: CollectJob) -> CollectOutput:
    try:
        runnable = runtimes.load_runnable(job.spec, job.plan, resolve_device(job.plan, job.device))
    except Unsupported as why:
        return CollectOutput(status="unsupported", reason=str(why))
    with runnable:
        return CollectOutput(status="ok", outputs=collect(runnable, job.config), notes=tuple(runnable.notes))


def _reference_key(spec: ModelSpec, config: QualityConfig, device: str | None) -> str:
    if spec.builder is not None:  # custom: the builder's module or the saved object make it this model
        files = files_of(spec.builder, spec.source)
    else:
        files = [p for p in Path(spec.source).glob("*") if p.is_file()]
    stamps = sorted((p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in files)
    text = inputs.evaluation_digest() if spec.task in GENERATE_TASKS else None  # pydoc's topics differ by Python
    blob = json.dumps(
        [spec.to_dict(), asdict(config), device, __version__, stamps, text, FORMAT], sort_keys=True, default=str
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def reference_outputs(
    spec: ModelSpec, config: QualityConfig, *, device: str | None = None, timeout_s: float = 1800
) -> dict[str, Any]:
    """fp32 eager outputs on the real inputs, from the cache or a fresh child process."""
    path = cache_dir() / "references" / f"{_reference_key(spec, config, device)}.pkl"
    if path.is_file():
        return pickle.loads(path.read_bytes())
    log.info("computing the fp32 eager reference of %s", spec.name)
    outcome = run_isolated(
        ChildJob(
            target="accelab.quality.verify:collect_in_child",
            payload=CollectJob(spec=spec, plan=reference_plan(spec), config=config, device=device),
            timeout_s=timeout_s,
        )
    )
    output: CollectOutput = outcome.unwrap()
    if output.status != "ok":
        raise RuntimeError(f"the fp32 reference of {spec.name} could not run: {output.reason}")
    assert output.outputs is not None, "an ok collection has outputs"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(output.outputs))
    tmp.replace(path)  # atomic: a killed run never leaves a half-written reference
    return output.outputs


def judge_outputs(task: str, reference: dict[str, Any], candidate: dict[str, Any], tolerance: str) -> dict[str, Any]:
    """Result.quality: the verdict and the figures it came from.

    {"verdict": pass | warn | fail | cannot tell, "possible": the outcomes left, "tolerance",
    "metrics": {name: value}, "intervals": {name: [low, high]} (95%), "sample": {unit, n,
    per_sample, method, ...}, "rules": one line per rule, "samples_needed": --samples that would
    tell (cannot tell only), "source": where the lines come from}"""
    figures = compare(task, reference, candidate)
    judgement = judge(task, figures, tolerance)
    return {"tolerance": tolerance, **figures, **judgement.to_dict(), "source": SOURCES[task]}


def verify(
    spec: ModelSpec,
    plan: Plan,
    config: QualityConfig,
    *,
    tolerance: str = "balanced",
    device: str | None = None,
    timeout_s: float = 1800,
    tag: str | None = None,
) -> Result:
    reference = reference_outputs(spec, config, device=device, timeout_s=timeout_s)
    outcome = run_isolated(
        ChildJob(
            target="accelab.quality.verify:collect_in_child",
            payload=CollectJob(spec=spec, plan=plan, config=config, device=device),
            timeout_s=timeout_s,
        )
    )
    machine = environment()
    result = Result(
        kind="verify",
        status="error",
        model=spec.to_dict(),
        plan=plan.to_dict(),
        workload={"scenario": "verify", **asdict(config)},
        environment=machine,
        fingerprint=fingerprint(machine),
        command=command_line(),
        tag=tag,
    )
    if not outcome.ok:
        result.status, result.reason = outcome.status, outcome.reason
        result.metrics = {"traceback": outcome.traceback} if outcome.traceback else {}
        return result
    output: CollectOutput = outcome.value
    result.status, result.reason, result.notes = output.status, output.reason, list(output.notes)
    if output.status == "ok":
        result.quality = judge_outputs(spec.task, reference, output.outputs or {}, tolerance)
    return result
