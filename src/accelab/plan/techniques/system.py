"""Process settings: intra-/inter-op threads, TF32, cudnn.benchmark.

Every change is made through `apply`, which registers the previous values on the Runnable's
exit stack, so no flag outlives the run that asked for it (closing the Runnable restores them). The one exception is
inter-op threads: torch accepts `set_num_interop_threads` once per process, before any
parallel work, and never again, so it cannot be restored; accelab runs one plan per child
process, where the first call succeeds.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch

from accelab.catalog.spec import ModelSpec
from accelab.plan.plan import Plan
from accelab.plan.runtime import Runnable, Unsupported

log = logging.getLogger(__name__)


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which containers narrow), not the host's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def threads_for(plan: Plan) -> int:
    """The plan's threads, else every CPU this process may use (what torch uses by default)."""
    return plan.threads or available_cpus()


def check(plan: Plan, spec: ModelSpec, device: torch.device) -> None:
    if (plan.tf32 or plan.cudnn_benchmark) and device.type != "cuda":
        raise Unsupported("TF32 and cudnn.benchmark are GPU settings; this run is on CPU")
    cpus = available_cpus()
    for field, value in (("threads", plan.threads), ("interop_threads", plan.interop_threads)):
        if value is not None and value > cpus:
            raise Unsupported(
                f"{field}={value} is more than the {cpus} CPUs this process may use: "
                "extra threads would only time-share cores"
            )


def apply(runnable: Runnable, plan: Plan) -> None:
    """Set the plan's process settings; closing the Runnable restores them (and a failure here
    restores at once what this step had set)."""
    stack = contextlib.ExitStack()
    try:
        _set_threads(stack, plan)
        if plan.tf32:
            _set_tf32(stack)
        if plan.cudnn_benchmark:
            previous = torch.backends.cudnn.benchmark
            torch.backends.cudnn.benchmark = True
            stack.callback(setattr, torch.backends.cudnn, "benchmark", previous)
            log.info("cudnn.benchmark on (was %s)", previous)
    except BaseException:
        stack.close()
        raise
    runnable.exit_stack.enter_context(stack)


def _set_threads(stack: contextlib.ExitStack, plan: Plan) -> None:
    if plan.threads is not None:
        previous = torch.get_num_threads()
        torch.set_num_threads(plan.threads)
        stack.callback(torch.set_num_threads, previous)
        log.info("intra-op threads %d (was %d)", plan.threads, previous)
    if plan.interop_threads is not None and plan.interop_threads != torch.get_num_interop_threads():
        try:
            torch.set_num_interop_threads(plan.interop_threads)
        except RuntimeError:
            raise Unsupported(
                f"interop_threads={plan.interop_threads} cannot be set: torch allows it once per process, before "
                f"any parallel work, and this process already runs with {torch.get_num_interop_threads()}"
            ) from None
        # not restorable: torch refuses a second call (see the module docstring)
        log.info("inter-op threads %d (for the rest of this process)", plan.interop_threads)


def _set_tf32(stack: contextlib.ExitStack) -> None:
    # The fp32_precision API (torch >= 2.9); mixing it with the legacy allow_tf32 flags raises.
    # cudnn convolutions already default to "tf32" in torch; matmuls default to "none" (ieee).
    # torch swaps the cudnn module for an object whose class has `conv`; its stub is the module's
    for backend in (torch.backends.cuda.matmul, torch.backends.cudnn.conv):  # type: ignore[attr-defined]
        previous = backend.fp32_precision
        backend.fp32_precision = "tf32"
        stack.callback(setattr, backend, "fp32_precision", previous)
    log.info("TF32 on for CUDA matmuls and cudnn convolutions")
