"""Training MFU: model FLOPs per second over the peak this machine measured for the run's compute
path, scaled to what the run used. Pure arithmetic; the peaks come from `accelab env`'s cache
(accelab.measure.hardware), the forward's FLOPs from the worker (step_split / split_probes).

    model FLOPs per sample = 3 x forward FLOPs (backward = 2 x forward: the gradients of the
                             activations and of the weights; activation checkpointing's
                             recomputed forward is not model FLOPs and is not counted)
    MFU = model FLOPs per sample x samples/s / peak

The peak is the best FLOP/s of the kernels models run, measured at `measured_threads` intra-op
threads. A CPU run with fewer threads in all (processes x threads) gets that share of it; one
with more gets the whole measured peak, no more (the cores are the limit). A GPU run gets one
device's peak per process. An MFU above 100% is never reported: the peak was underestimated
(measured on a busy machine, or a kernel the model runs is faster than those measured), and the
row says so instead.
"""

from __future__ import annotations

from typing import Any

from accelab.results import contract as K

TRAIN_FLOPS_PER_FORWARD = 3.0


def row_peak(measured_flops: float, *, measured_threads: int, threads: int, processes: int, cuda: bool) -> float:
    """The peak FLOP/s a run could reach: one device's per process on GPUs; on CPU the measured
    peak times the share of the measured threads the run used (processes x threads), at most 1."""
    if cuda:
        return measured_flops * processes
    used = threads * processes
    return measured_flops * min(used, measured_threads) / measured_threads


def train_mfu(
    *, forward_flops_per_sample: float | None, samples_per_s: float | None, peak_flops: float | None, path: str
) -> dict[str, Any]:
    """Result metrics: achieved_flops and mfu (a fraction, 0..1), or mfu_unknown with why."""
    if not forward_flops_per_sample:
        return {K.MFU_UNKNOWN: "MFU unknown: the forward's FLOPs were not counted (see the worker's log)"}
    if not samples_per_s:
        return {K.MFU_UNKNOWN: "MFU unknown: no timed steps (raise --max-steps above --bench-warmup)"}
    achieved = TRAIN_FLOPS_PER_FORWARD * forward_flops_per_sample * samples_per_s
    if not peak_flops:
        return {
            K.ACHIEVED_FLOPS: achieved,
            K.MFU_UNKNOWN: f"MFU unknown: no measured {path} peak on this machine; `accelab env` measures it",
        }
    value = achieved / peak_flops
    if value > 1.0:
        return {
            K.ACHIEVED_FLOPS: achieved,
            K.MFU_UNKNOWN: (
                f"MFU unknown: training ran at {achieved / 1e9:.1f} GFLOP/s, above the {path} peak measured here "
                f"({peak_flops / 1e9:.1f} GFLOP/s for its threads): the peak was underestimated (measured on a "
                "busy machine?); `accelab env --refresh` measures it again"
            ),
        }
    return {K.ACHIEVED_FLOPS: achieved, K.MFU: value}
