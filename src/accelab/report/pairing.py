"""Like with like: which baseline run the regression gate compares with which candidate run.

Runs are paired by (model, plan name, workload shape: scenario, batch, sequence length, new
tokens, image size, input source), the newest of each key on each side. When each side is a
single run, the two are compared directly; they must then have the same model and workload,
while their plans may differ (that is what a change under test does: the differing plan fields
are listed as a warning). Runs from machines with different fingerprints (CPU model, core
counts, GPUs, driver, torch / transformers / accelerate versions) are not compared as equals:
`machine_check` says how they differ, and `regress.compare` refuses or warns. Pure.
"""

from __future__ import annotations

from typing import Any

from accelab.measure.environment import FINGERPRINT_KEYS, FINGERPRINT_VERSIONS
from accelab.report import metrics as M
from accelab.results.result import Result

MACHINES_DIFFER = "results from different machines are not compared as equals"


def pair_key(result: Result) -> tuple[Any, ...]:
    return (M.model_name(result), M.plan_name(result), M.workload_key(result))


def pair_label(result: Result) -> str:
    return f"{M.model_name(result)} · {M.plan_name(result)} · {M.workload_label(result)}"


def _newest_by_key(results: list[Result]) -> dict[tuple[Any, ...], Result]:
    chosen: dict[tuple[Any, ...], Result] = {}
    for r in sorted(results, key=lambda r: r.created, reverse=True):
        chosen.setdefault(pair_key(r), r)
    return chosen


def pair_runs(
    baseline: list[Result], candidate: list[Result]
) -> tuple[list[tuple[Result, Result]], list[Result], list[Result]]:
    """(pairs, baseline runs without a partner, candidate runs without a partner)."""
    if not baseline or not candidate:
        side = "baseline" if not baseline else "candidate"
        raise ValueError(f"the {side} has no runs to compare")
    if len(baseline) == 1 and len(candidate) == 1:
        base, cand = baseline[0], candidate[0]
        _require_same_work(base, cand)
        return [(base, cand)], [], []
    base_by, cand_by = _newest_by_key(baseline), _newest_by_key(candidate)
    pairs = [(base_by[k], cand_by[k]) for k in base_by if k in cand_by]
    if not pairs:
        raise ValueError(
            "no baseline run matches a candidate run by (model, plan, workload): baseline has "
            f"{sorted({pair_label(r) for r in base_by.values()})}, candidate has "
            f"{sorted({pair_label(r) for r in cand_by.values()})}; measure both with the same command"
        )
    only_b = [r for k, r in base_by.items() if k not in cand_by]
    only_c = [r for k, r in cand_by.items() if k not in base_by]
    return pairs, only_b, only_c


def _require_same_work(base: Result, cand: Result) -> None:
    if M.model_name(base) != M.model_name(cand):
        raise ValueError(
            f"baseline is model {M.model_name(base)!r}, candidate is {M.model_name(cand)!r}: "
            "regress compares the same model; pick runs of one model"
        )
    if M.workload_key(base) != M.workload_key(cand):
        diffs = [
            f"{name} {b!r} -> {c!r}"
            for name, b, c in zip(M.WORKLOAD_SHAPE, M.workload_key(base), M.workload_key(cand))
            if b != c
        ]
        raise ValueError(
            f"baseline and candidate ran different workloads ({', '.join(diffs)}): "
            "latencies of different work are not comparable; rerun with the same shapes"
        )


def plan_differences(base: dict[str, Any], cand: dict[str, Any]) -> list[str]:
    keys = sorted(set(base) | set(cand))
    return [f"{k} {base.get(k)!r} -> {cand.get(k)!r}" for k in keys if base.get(k) != cand.get(k)]


def machine_differences(base: dict[str, Any], cand: dict[str, Any]) -> list[str]:
    """The fingerprinted parts of two environments that differ, for the warning."""
    diffs = []
    for key in FINGERPRINT_KEYS:
        if key == "versions":
            for name in FINGERPRINT_VERSIONS:
                b, c = (base.get("versions") or {}).get(name), (cand.get("versions") or {}).get(name)
                if b != c:
                    diffs.append(f"{name} {b} -> {c}")
        elif key == "gpus":
            b, c = [g.get("name") for g in base.get("gpus") or []], [g.get("name") for g in cand.get("gpus") or []]
            if b != c:
                diffs.append(f"gpus {b or 'none'} -> {c or 'none'}")
        elif base.get(key) != cand.get(key):
            diffs.append(f"{key} {base.get(key)!r} -> {cand.get(key)!r}")
    return diffs


def machine_check(base: Result, cand: Result) -> str | None:
    """None when both ran on the same machine class; else the message that says how they differ."""
    if base.fingerprint and base.fingerprint == cand.fingerprint:
        return None
    if not base.fingerprint or not cand.fingerprint:
        return (
            f"a machine fingerprint is missing (baseline {base.fingerprint or '?'}, candidate "
            f"{cand.fingerprint or '?'}): cannot tell whether both ran on the same machine"
        )
    diffs = machine_differences(base.environment, cand.environment)
    detail = "; ".join(diffs) if diffs else "fingerprinted fields not recorded"
    return f"{MACHINES_DIFFER}: baseline {base.fingerprint} vs candidate {cand.fingerprint} ({detail})"
