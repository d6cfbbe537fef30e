"""The plan space a tune searches, pruned of what cannot run (or cannot help) on this device."""

from __future__ import annotations

from dataclasses import dataclass

from accelab.catalog.spec import ModelSpec
from accelab.plan.presets import PRESETS

# Candidate variants per scenario, each a preset. Batch size is searched separately.
VARIANTS: dict[str, tuple[str, ...]] = {
    "forward": (
        "baseline", "bf16-autocast", "fp16-autocast", "bf16", "fp16", "compile", "int8-dynamic",
        "int8-weight-compile", "channels-last", "onnxruntime", "onnxruntime-fused", "onnxruntime-int8", "openvino",
    ),
    "generate": (
        "baseline", "bf16-autocast", "fp16-autocast", "bf16", "static-cache", "compile-static",
        "int8-weight", "int8-weight-compile", "llamacpp",
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


def search_space(
    spec: ModelSpec,
    scenario: str,
    device: str | None,
    *,
    max_batch: int,
    include: list[str] | None = None,
    exclude: list[str] | None = None,
) -> Space:
    import torch

    from accelab.plan.apply import check_supported, resolve_device
    from accelab.plan.runtime import Unsupported

    names = list(include) if include else list(VARIANTS[scenario])
    unknown = [n for n in names + list(exclude or []) if n not in PRESETS]
    if unknown:
        raise ValueError(f"unknown plan(s) {', '.join(unknown)} in the search space; presets: {', '.join(PRESETS)}")
    if "baseline" not in names:
        names.insert(0, "baseline")  # speed-ups are always against the fp32 eager baseline
    variants, pruned = [], {}
    for name in names:
        if name in (exclude or []):
            pruned[name] = "excluded with --exclude"
            continue
        plan = PRESETS[name]
        try:
            check_supported(plan, spec, resolve_device(plan, device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        except Unsupported as why:
            pruned[name] = str(why)
            continue
        variants.append(name)
    return Space(variants=variants, pruned=pruned, batch_sizes=ladder(max_batch))
