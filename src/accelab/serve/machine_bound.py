"""How close each continuous step comes to this machine's bound.

A step must at least read every weight once and each sequence's KV once (bytes over the
measured read bandwidth), and do its GEMMs and attention (FLOPs over the measured peak of the
precision it runs in); the larger of the two is the least time the step can take here. The
fraction of that over the step's wall time is what /metrics reports per step
(`accelab_step_machine_fraction`): 1.0 is the machine's limit, and what is left is overhead
(Python, dispatch, small kernels) or kernels slower than the measured ones.

The limits are those `accelab env` measured and cached for this machine, software and thread
count (`accelab.measure.hardware`); the server never measures them itself (it would take the
cores from the requests). A fraction above 1 means the limits were measured on a busier machine:
it is reported as 1.0 and the log says so once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from accelab.measure import hardware
from accelab.serve.engines.base import StepCost

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MachineBound:
    bandwidth: float  # bytes/s read
    peak_flops: float  # FLOP/s of the step's compute path
    path: str  # that path ("fp32", "bf16")

    def seconds(self, cost: StepCost) -> float:
        """The least time a step of this cost takes here."""
        return max(cost.bytes_read / self.bandwidth, cost.flops / self.peak_flops)

    def fraction(self, cost: StepCost, seconds: float) -> float:
        """The bound over the measured time, in [0, 1]."""
        if seconds <= 0:
            return 0.0
        value = self.seconds(cost) / seconds
        if value > 1.0:
            _warn_once(value)
            return 1.0
        return value


_warned: set[str] = set()


def _warn_once(value: float) -> None:
    if "above" not in _warned:
        _warned.add("above")
        log.warning(
            "a step ran at %.0f%% of the bound from the cached machine limits: they were measured on a busier "
            "machine; run `accelab env --refresh` when it is quiet (reported as 100%% until then)",
            value * 100,
        )


def for_device(device: str, path: str) -> MachineBound | None:
    """The bound from the cached limits of `device` for compute path `path`; None (and a log
    line saying how to get them) where this machine has not been measured."""

    limits = hardware.cached_limits(device)
    if limits is None:
        log.info(
            "no measured limits for this machine: run `accelab env` once and /metrics reports each step's "
            "fraction of the machine's bound (accelab_step_machine_fraction)"
        )
        return None
    _, peak = limits.peak_for({"bf16": "bf16-weights", "fp16": "fp16-weights"}.get(path, "fp32"))
    if not peak or not limits.bandwidth_bytes_per_s:
        log.info("the cached machine limits have no %s peak or no bandwidth: no step fractions", path)
        return None
    return MachineBound(bandwidth=limits.bandwidth_bytes_per_s, peak_flops=peak, path=path)
