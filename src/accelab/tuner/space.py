"""The plan space a tune searches, pruned of what cannot run (or cannot help) on this device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from accelab.catalog.spec import ModelSpec
from accelab.measure.capabilities import plan_techniques, slow_techniques
from accelab.plan.apply import resolve_device
from accelab.plan.plan import Plan
from accelab.plan.presets import PRESETS
from accelab.plan.runtime import Unsupported
from accelab.runtimes import check_supported

# Candidate variants per scenario, each a preset. Batch size is searched separately.
VARIANTS: dict[str, tuple[str, ...]] = {
    "forward": (
        "baseline",
        "bf16-autocast",
        "fp16-autocast",
        "bf16",
        "fp16",
        "compile",
        "int8-dynamic",
        "int8-weight-compile",
        "channels-last",
        "onnxruntime",
        "onnxruntime-fused",
        "onnxruntime-int8",
        "openvino",
    ),
    "generate": (
        "baseline",
        "bf16-autocast",
        "fp16-autocast",
        "bf16",
        "static-cache",
        "compile-static",
        "int8-weight",
        "int8-weight-compile",
        "llamacpp",
        "vllm",
        "vllm-bf16",
        "vllm-compiled",
        "openvino",
        "openvino-int8",
        "openvino-int8-bf16",
    ),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Space:
    variants: list[str]
    pruned: dict[str, str]  # variant -> why it is not searched here
    batch_sizes: list[int]


def ladder(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to max_batch (max_batch itself included)."""
    if max_batch < 1:
        raise ValueError(f"--max-batch {max_batch} must be 1 or more")
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return [*sizes, max_batch]


def techniques(plan: Plan) -> list[str]:
    used = plan_techniques(plan)
    if plan.backend == "vllm":  # vLLM's dtype is its own option, and the probes judge it like torch's
        used += {"bfloat16": ["bf16-weights"], "float16": ["fp16-weights"]}.get(plan.option.get("vllm_dtype", ""), [])
    if plan.backend == "openvino" and plan.option.get("ov_precision") == "bf16":
        used += ["bf16-weights"]
    return used


def slow_here(device: torch.device) -> dict[str, str]:
    """Techniques the capability report expects to run slower than fp32 eager on `device`
    (judged by the probes and peaks `accelab env` measured and cached), with why."""
    return slow_techniques(device)


def search_space(
    spec: ModelSpec,
    scenario: str,
    device: str | None,
    *,
    max_batch: int,
    include: list[str] | None = None,
    exclude: list[str] | None = None,
    prune_slow: bool = False,
) -> Space:
    """The presets of `scenario` (or `include`) that can run here, and the batch ladder.
    With `prune_slow`, presets that use a technique the capability report calls slow here are
    left out too (they cannot win on speed)."""
    names = list(include) if include else list(VARIANTS[scenario])
    unknown = [n for n in names + list(exclude or []) if n not in PRESETS]
    if unknown:
        raise ValueError(f"unknown plan(s) {', '.join(unknown)} in the search space; presets: {', '.join(PRESETS)}")
    if "baseline" not in names:
        names.insert(0, "baseline")  # speed-ups are always against the fp32 eager baseline
    variants, pruned = [], {}
    target = resolve_device(PRESETS["baseline"], device)
    slow = slow_here(target) if prune_slow else {}
    for name in names:
        if name in (exclude or []):
            pruned[name] = "excluded with --exclude"
            continue
        plan = PRESETS[name]
        try:
            check_supported(plan, spec, resolve_device(plan, device) if device else target)
        except Unsupported as reason:
            pruned[name] = str(reason)
            continue
        if name != "baseline" and (why := next((slow[t] for t in techniques(plan) if t in slow), None)):
            pruned[name] = f"{why} (name it in --include to search it anyway)"
            continue
        variants.append(name)
    return Space(variants=variants, pruned=pruned, batch_sizes=ladder(max_batch))
