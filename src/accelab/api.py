"""The Python API: the CLI's measuring commands as typed functions, and `apply` for your own code.

    import accelab
    result = accelab.bench("minilm-l6", plan="compile", workload={"batch_size": 8})
    rows = accelab.compare(my_net, plans=["baseline", "channels-last"], inputs=torch.randn(1, 3, 64, 64))
    verdict = accelab.verify("smollm2-135m", plan="int8-weight").quality["verdict"]
    best = accelab.tune(my_net, inputs=example, goal="throughput")       # -> Plan
    fast = accelab.apply(my_net, best)                                   # -> Runnable: .model, .notes

`model` is anything the CLI takes (a catalog name, a local directory or .gguf file, a Hub id,
"package.module:callable"), a callable that returns a model, or a model object: a transformers
model (saved once with its processor, so every technique applies) or any `torch.nn.Module`
(saved once with cloudpickle; see `accelab.catalog.custom`). Each measurement runs in its own
child process, as on the command line, and its Result goes to the same results store
(`db=None`: the default store; `store=False` keeps it out).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accelab.scenarios.workload import Workload, resolve_batch_size

if TYPE_CHECKING:
    import torch

    from accelab.catalog.spec import ModelSpec
    from accelab.measure.budget import PlanBudget
    from accelab.plan.plan import Plan
    from accelab.plan.runtime import Runnable
    from accelab.results.result import Result
    from accelab.tuner.run import Percentile, TuneGoal, TuneScenario
    from accelab.tuner.search import QualityLevel

__all__ = ["apply", "bench", "compare", "model_spec", "tune", "verify"]

ModelLike = Any  # str | Callable[[], nn.Module] | nn.Module | CustomModel
PlanLike = Any  # str (preset or YAML file) | Path | Plan
WorkloadLike = Any  # Workload | dict of its fields | None


def bench(
    model: ModelLike,
    plan: PlanLike = "baseline",
    workload: WorkloadLike = None,
    *,
    inputs: Any = None,
    task: str | None = None,
    processor: Any = None,
    device: str | None = None,
    quality: bool = False,
    tolerance: str = "balanced",
    timeout_s: float = 1800.0,
    store: bool = True,
    db: str | Path | None = None,
    tag: str | None = None,
) -> Result:
    """Measure `model` under one plan and workload (latency, throughput, memory, MFU or roofline).

    `workload`: a Workload or a dict of its fields (scenario, batch_size, seq_len, new_tokens,
    image_size, inputs, min_seconds, ...); the scenario defaults to generate for generative
    models, else forward. `inputs`/`task`/`processor`: for model objects (see `model_spec`).
    With `quality`, the outputs are judged against the fp32 eager reference too."""
    from accelab.benchmark.compare import quality_config_for
    from accelab.benchmark.engine import bench as run_bench

    spec = model_spec(model, inputs=inputs, task=task, processor=processor)
    plan_obj = _plan(plan)
    work = _workload(spec, workload, plan_obj)
    qconfig = quality_config_for(spec.task, work, None, 8) if quality else None
    result = run_bench(
        spec, plan_obj, work, device=device, timeout_s=timeout_s, tag=tag, quality=qconfig, tolerance=tolerance
    )
    _keep([result], store, db)
    return result


def compare(
    model: ModelLike,
    plans: Sequence[PlanLike] = ("baseline", "compile"),
    workload: WorkloadLike = None,
    *,
    inputs: Any = None,
    task: str | None = None,
    processor: Any = None,
    device: str | None = None,
    quality: bool = True,
    samples: int | None = None,
    tolerance: str = "balanced",
    timeout_s: float = 1800.0,
    max_seconds_per_plan: float | None = None,
    rounds: int = 6,
    sequential: bool = False,
    store: bool = True,
    db: str | Path | None = None,
    tag: str | None = None,
) -> list[Result]:
    """Several plans side by side, each in its own warm process, measured in `rounds` alternating
    rounds (or one after another with `sequential`): one Result per plan, the first the
    reference row, the others with their paired speed-up and its interval (`metrics["speedup"]`)
    and every row with the machine's noise (`metrics["noise"]`); `accelab.results.compare_table.
    render(results)` prints the CLI's table. A plan that cannot run here is a Result with status
    "unsupported" and the reason."""
    from accelab.benchmark.compare import quality_config_for, run_compare
    from accelab.benchmark.rounds import RoundsConfig

    if not plans:
        raise ValueError("plans is empty; give e.g. plans=['baseline', 'compile']")
    spec = model_spec(model, inputs=inputs, task=task, processor=processor)
    plan_objs = [_plan(p) for p in plans]
    work = _workload(spec, workload, None)
    qconfig = quality_config_for(spec.task, work, samples, 8) if quality else None
    results = run_compare(
        spec,
        plan_objs,
        work,
        device=device,
        quality=qconfig,
        tolerance=tolerance,
        timeout_s=timeout_s,
        tag=tag,
        budget=_plan_budget(plan_objs[0], device, max_seconds_per_plan),
        rounds=RoundsConfig(rounds=rounds, sequential=sequential),
    )
    _keep(results, store, db)
    return results


def _plan_budget(first: Plan, device: str | None, max_seconds_per_plan: float | None) -> PlanBudget:
    """Each plan's time: the one given, or a budget for the techniques known to be slow on the
    device the first plan runs on (measured here)."""
    from accelab.measure.budget import PlanBudget
    from accelab.measure.capabilities import slow_techniques
    from accelab.plan.apply import resolve_device

    return PlanBudget(
        explicit_s=max_seconds_per_plan, slow=slow_techniques(resolve_device(first, device), measure=True)
    )


def verify(
    model: ModelLike,
    plan: PlanLike,
    *,
    inputs: Any = None,
    task: str | None = None,
    processor: Any = None,
    samples: int | None = None,
    new_tokens: int = 16,
    batch_size: int = 8,
    tolerance: str = "balanced",
    device: str | None = None,
    timeout_s: float = 1800.0,
    store: bool = True,
    db: str | Path | None = None,
    tag: str | None = None,
) -> Result:
    """A plan's outputs against the fp32 eager reference on the same inputs; the verdict
    (pass / warn / fail / cannot tell), its figures with their 95% intervals and the rules are
    in `result.quality`. `samples` None: the task's default (`quality.collect.DEFAULT_SAMPLES`)."""
    from accelab.quality.collect import config_for
    from accelab.quality.verdict import rules_for
    from accelab.quality.verify import verify as run_verify

    spec = model_spec(model, inputs=inputs, task=task, processor=processor)
    rules_for(spec.task, tolerance)  # a bad tolerance fails before any process starts
    config = config_for(spec.task, samples, new_tokens=new_tokens, batch_size=batch_size)
    result = run_verify(spec, _plan(plan), config, tolerance=tolerance, device=device, timeout_s=timeout_s, tag=tag)
    _keep([result], store, db)
    return result


def tune(
    model: ModelLike,
    *,
    goal: TuneGoal = "throughput",
    percentile: Percentile = "p99",
    inputs: Any = None,
    task: str | None = None,
    processor: Any = None,
    scenario: TuneScenario = "auto",
    batch_size: int | None = None,
    max_batch: int | None = None,
    seq_len: int = 128,
    new_tokens: int = 32,
    image_size: int | None = None,
    max_memory: str | None = None,
    p99_ms: float | None = None,
    quality: QualityLevel = "balanced",
    budget: str | None = None,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    min_seconds: float = 3.0,
    device: str | None = None,
    out: str | Path | None = None,
    db: str | Path | None = None,
    fresh: bool = False,
) -> Plan:
    """Search the plan space for `goal` under the memory, latency and quality limits, as
    `accelab tune` does (same search, same store, resumable); returns the winning Plan, with its
    batch size, and writes it as YAML to `out` when given. Raises ValueError when no plan meets
    the limits (the message says which limit ruled each out)."""
    from accelab.tuner.run import TuneRequest, tune as run_tune

    spec = model_spec(model, inputs=inputs, task=task, processor=processor)
    request = TuneRequest(
        spec=spec,
        goal=goal,
        percentile=percentile,
        scenario=scenario,
        batch_size=batch_size,
        max_batch=max_batch,
        seq_len=seq_len,
        new_tokens=new_tokens,
        image_size=image_size,
        max_memory=max_memory,
        p99_ms=p99_ms,
        quality=quality,
        budget=budget,
        include=list(include) if include else None,
        exclude=list(exclude) if exclude else None,
        min_seconds=min_seconds,
        device=device,
        out=Path(out) if out else None,
        db=db,
        fresh=fresh,
    )
    outcome = run_tune(request)
    if outcome.plan is None:
        raise ValueError(outcome.no_feasible_reason or "no plan met the limits")
    return outcome.plan


def apply(model: torch.nn.Module, plan: PlanLike, *, device: str | None = None, processor: Any = None) -> Runnable:
    """`plan`'s techniques on your model object, in this process, in accelab's fixed order
    (threads, weight dtype / attention, device, channels_last, int8 weights, autocast, KV cache,
    compile). Returns the Runnable: `.model` is the accelerated model to call as before (autocast
    and compile are inside its forward), `.generate(...)` adds the plan's generate arguments,
    `.notes` say what each technique did. Techniques that cannot help here raise
    `accelab.plan.runtime.Unsupported` with the reason. `close()` restores the thread settings."""
    import torch

    from accelab.plan.apply import apply_to_model, resolve_device

    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"accelab.apply takes a torch.nn.Module; got a {type(model).__name__}. "
            "For a catalog name or a directory use accelab.bench, or load it first"
        )
    plan_obj = _plan(plan)
    return apply_to_model(model, plan_obj, resolve_device(plan_obj, device), processor=processor)


# -- what the functions share ---------------------------------------------------------------------
def model_spec(model: ModelLike, *, inputs: Any = None, task: str | None = None, processor: Any = None) -> ModelSpec:
    """The ModelSpec every function measures:
    - a string: resolved as on the command line (catalog, directory, .gguf, module:callable, Hub id);
    - a transformers model object: saved once (save_pretrained, with `processor` or the one of
      its `name_or_path`) under the cache, content-addressed, then loaded like a directory;
    - any other nn.Module, or an `accelab.CustomModel`: saved once with cloudpickle, with its
      example `inputs` (a tensor, tuple or dict of tensors with the batch first) and `task`;
    - a callable: an importable function becomes its "module:callable" target; another
      callable (a lambda, a notebook function) is called once and its model saved as above."""
    import torch

    from accelab.catalog import custom
    from accelab.catalog.resolve import from_object, resolve

    if isinstance(model, str):
        if inputs is not None or processor is not None:
            raise ValueError("inputs= and processor= are for model objects; a named model brings its own")
        return resolve(model, task)
    if isinstance(model, torch.nn.Module) and hasattr(model, "save_pretrained") and hasattr(model, "config"):
        if inputs is not None:
            raise ValueError("a transformers model takes its inputs from its processor; pass processor=, not inputs=")
        return resolve(str(_save_pretrained(model, processor)), task)
    if isinstance(model, (torch.nn.Module, custom.CustomModel)):
        return from_object(model, inputs=inputs, task=task)
    if callable(model):
        target = _importable_target(model)
        if target is not None and inputs is None:
            return resolve(target, task)
        return from_object(
            custom.as_bundle(model(), getattr(model, "__name__", "the callable")), inputs=inputs, task=task
        )
    raise TypeError(f"model is a {type(model).__name__}; pass a name, a path, a Hub id, a callable or an nn.Module")


def _importable_target(fn: Callable) -> str | None:
    from accelab.catalog import custom

    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<" in name:
        return None
    target = f"{module}:{name}"
    return target if custom.is_target(target) else None


def _save_pretrained(model: Any, processor: Any) -> Path:
    """A transformers model object (and its processor) as a directory, named by a hash of its
    config and weights: the same model twice is one directory and one cached reference."""
    import torch

    from accelab.paths import cache_dir

    digest = hashlib.sha256(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    directory = cache_dir() / "objects" / digest.hexdigest()[:20]
    if (directory / "config.json").is_file():
        return directory
    processor = processor or _processor_of(model)
    tmp = directory.with_name(directory.name + ".tmp")
    model.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    tmp.replace(directory)  # atomic: a half-written model directory is never used
    return directory


def _processor_of(model: Any) -> Any:
    from transformers import AutoProcessor

    source = getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
    try:
        return AutoProcessor.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"{type(model).__name__} has no processor accelab can find ({source or 'no name_or_path'}): pass "
            "processor= (its tokenizer or image processor)"
        ) from err


def _plan(plan: PlanLike) -> Plan:
    from accelab.plan.plan import Plan, load_plan

    return plan if isinstance(plan, Plan) else load_plan(plan)


def _workload(spec: ModelSpec, workload: WorkloadLike, plan: Plan | None) -> Workload:
    from accelab.benchmark.options import default_scenario, validate

    if isinstance(workload, Workload):
        return workload
    given = dict(workload or {})
    known = {f.name for f in fields(Workload)}
    unknown = set(given) - known
    if unknown:
        raise ValueError(f"workload has unknown fields {sorted(unknown)}; allowed: {', '.join(sorted(known))}")
    if given.get("scenario", "auto") == "auto":
        given["scenario"] = default_scenario(spec.task)
    given["batch_size"] = resolve_batch_size(given.get("batch_size"), plan, 1)
    work = Workload(**given)
    validate(spec, work)
    return work


def _keep(results: list[Result], store: bool, db: str | Path | None) -> None:
    if store:
        from accelab.results.store import open_store

        open_store(db).add(*results)
