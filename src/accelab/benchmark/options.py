"""From command-line options to (ModelSpec, Plan, Workload), validated before any child starts."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from accelab.catalog.facts import GENERATE_TASKS, max_sequence_length
from accelab.catalog.spec import ModelSpec
from accelab.options import fields_of
from accelab.plan.plan import Plan, load_plan
from accelab.scenarios.workload import Workload, resolve_batch_size

DEFAULT_BATCH = 1  # bench and compare, when neither --batch-size nor the plan sets one


@dataclass(frozen=True, kw_only=True, slots=True)
class Request:
    spec: ModelSpec
    plan: Plan
    workload: Workload


def default_scenario(task: str) -> Literal["forward", "generate"]:
    return "generate" if task in GENERATE_TASKS else "forward"


def resolve_plan(plan: str, overrides: list[str], threads: int | None) -> Plan:
    extra = [*overrides, *([f"threads={threads}"] if threads is not None else [])]
    return load_plan(plan, extra)


def request_from(options: Mapping[str, Any], *, plan: str) -> Request:
    """`build_request` from `accelab bench`'s or `compare`'s options (their parameters by name):
    each Workload field from the option of its name. `plan`: the one whose batch_size the
    workload takes when --batch-size is not given (compare: the first)."""
    return build_request(
        model=options["model"],
        task=options["task"],
        plan=plan,
        overrides=options["set_"],
        threads=options["threads"],
        scenario=options["scenario"],
        batch_size=options["batch_size"],
        **fields_of(Workload, options, skip={"scenario", "batch_size"}),
    )


def build_request(
    *,
    model: str,
    task: str | None,
    plan: str,
    overrides: list[str],
    threads: int | None,
    scenario: str,
    batch_size: int | None = None,
    **workload_fields: Any,
) -> Request:
    """`batch_size`: the --batch-size flag, None when not given (see `resolve_batch_size`)."""
    from accelab.catalog.resolve import resolve

    plan_obj = resolve_plan(plan, overrides, threads)  # cheap checks first: no model is fetched for a typo
    batch = resolve_batch_size(batch_size, plan_obj, DEFAULT_BATCH)
    workload = Workload(scenario="forward", batch_size=batch, **workload_fields)
    spec = resolve(model, task)
    chosen = default_scenario(spec.task) if scenario == "auto" else scenario
    workload = Workload.from_dict({**workload.to_dict(), "scenario": chosen})
    validate(spec, workload)
    return Request(spec=spec, plan=plan_obj, workload=workload)


def validate(spec: ModelSpec, workload: Workload) -> None:
    """Shape checks that need the model's config, done before a child process starts."""
    if workload.scenario == "generate" and spec.task not in GENERATE_TASKS:
        raise ValueError(
            f"scenario 'generate' needs a generative model; {spec.name} is {spec.task}. Use --scenario forward"
        )
    if workload.scenario == "forward" and spec.task in ("feature-extraction", "text-generation"):
        limit = spec_max_sequence_length(spec)
        if limit is not None and workload.seq_len > limit:
            raise ValueError(
                f"seq_len={workload.seq_len} is longer than {spec.name} can take: allowed 1..{limit}; "
                f"pass --seq-len {limit} or less"
            )


def spec_max_sequence_length(spec: ModelSpec) -> int | None:
    """The longest sequence from the model's config.json, read without loading transformers."""
    config_file = Path(spec.source) / "config.json"
    if not config_file.is_file():
        return None
    return max_sequence_length(json.loads(config_file.read_text()))
