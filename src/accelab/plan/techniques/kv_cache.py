"""KV cache implementation for `generate`: dynamic (grows per token) or static (preallocated).

A static cache keeps tensor shapes fixed across decode steps, which is what lets a compiled
forward run without recompiling; without compile it mostly costs the preallocation (on
CPU it measured slightly slower). transformers auto-compiles generate with a static cache
on GPUs; accelab turns that off, so compile happens only when the plan says so (the
compile step compiles forward itself) and "static cache" measures the cache alone.
"""

from __future__ import annotations

import torch

from accelab.catalog.facts import GENERATE_TASKS
from accelab.catalog.spec import ModelSpec
from accelab.plan.plan import Plan
from accelab.plan.runtime import Runnable, Unsupported


def check(plan: Plan, spec: ModelSpec, device: torch.device) -> None:
    if plan.kv_cache == "static" and spec.task not in GENERATE_TASKS:
        raise Unsupported(f"a static KV cache is a generate() option; {spec.task} models do not generate")


def apply(runnable: Runnable, plan: Plan) -> None:
    if plan.kv_cache != "static":
        return
    runnable.generate_kwargs["cache_implementation"] = "static"
    runnable.generate_kwargs["disable_compile"] = True
    note = "static KV cache"
    if plan.compile == "off":
        note += " without compile (transformers' auto-compile of generate disabled)"
    runnable.notes.append(note)
