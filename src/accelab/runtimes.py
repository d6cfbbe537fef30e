"""One seam for loading a runnable: `load_runnable(spec, plan, device)`, over a table of runtimes.

torch's entry is `plan.apply.apply_plan` (the techniques in their fixed order); ONNX Runtime,
OpenVINO and llama.cpp register theirs in `accelab.backends`. This module sits above both, so
`plan/` imports nothing from the backends. `check_supported` asks the same table before anything
is loaded: the torch techniques every plan uses, then the runtime's own check (what the model and
device allow, whether its package is installed), so tune and predict prune a plan without
starting a process for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from accelab.backends import BACKENDS
from accelab.catalog.spec import ModelSpec
from accelab.plan import apply
from accelab.plan.apply import check_techniques
from accelab.plan.plan import Plan
from accelab.plan.runtime import Runnable, Unsupported

__all__ = ["RUNTIMES", "Runtime", "check_supported", "load_runnable", "Unsupported"]

Check = Callable[[ModelSpec, Plan, torch.device], None]
Load = Callable[[ModelSpec, Plan, torch.device], Runnable]


@dataclass(frozen=True, kw_only=True, slots=True)
class Runtime:
    check: Check  # raises Unsupported (with the reason) when it cannot run this model here
    load: Load


def _torch_load(spec: ModelSpec, plan: Plan, device: torch.device) -> Runnable:
    return apply.apply_plan(spec, plan, device)


def _no_check(spec: ModelSpec, plan: Plan, device: torch.device) -> None:
    return None


def _table() -> dict[str, Runtime]:
    table = {"torch": Runtime(check=_no_check, load=_torch_load)}
    table.update({name: Runtime(check=entry.check, load=entry.load) for name, entry in BACKENDS.items()})
    return table


RUNTIMES: dict[str, Runtime] = _table()


def _runtime(plan: Plan) -> Runtime:
    runtime = RUNTIMES.get(plan.backend)
    if runtime is None:
        raise ValueError(f"backend={plan.backend!r} is not one of {', '.join(RUNTIMES)}")
    return runtime


def check_supported(plan: Plan, spec: ModelSpec, device: torch.device) -> None:
    """Raise Unsupported before loading anything when the plan cannot run here."""
    check_techniques(plan, spec, device)
    _runtime(plan).check(spec, plan, device)


def load_runnable(spec: ModelSpec, plan: Plan, device: torch.device) -> Runnable:
    """`spec` loaded and accelerated by `plan` on `device`; Unsupported when it cannot run here."""
    check_supported(plan, spec, device)
    return _runtime(plan).load(spec, plan, device)
