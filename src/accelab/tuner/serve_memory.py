"""How many candidate servers the machine holds at once. The serving tune measures its candidates
side by side, every server up; an 8B's servers do not all fit in 24 GiB. Each candidate's memory
is estimated before it starts (`accelab.plan.fit`: its weights at its plan's precision and the
overhead, or the peak its processes reached in this tune before, where the store has it), and the
candidates go out in groups that fit the available memory together, the first with the baseline:
a later group is measured after the earlier one's servers stopped, against the baseline's windows
of the first (the interleaving that evens out a noisy minute holds within a group). A candidate
that cannot fit even beside the baseline alone is left out with its figure.

Engine processes (vLLM, OpenVINO GenAI, llama.cpp) are counted at their plan's weights and an
overhead of 2 GiB: their KV pools are their own (vLLM's CPU default is 4 GiB), so the estimate is
rough there, and the tune's peak measurement stays the judge of `--max-memory`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from accelab.catalog.spec import ModelSpec
from accelab.plan import fit
from accelab.plan.plan import Plan
from accelab.tuner.serve_rank import Candidate

ENGINE_OVERHEAD = 2 << 30


@dataclass(frozen=True, slots=True)
class Groups:
    groups: list[list[str]]  # candidate keys, the baseline's group first
    left_out: dict[str, str]  # key -> why it cannot fit beside the baseline
    needs: dict[str, int]  # key -> the bytes counted for it
    available: int

    def describe(self) -> str:
        parts = [" + ".join(f"{key} {self.needs[key] / 1e9:.1f} GB" for key in group) for group in self.groups]
        return (
            f"one after the other within {self.available / 1e9:.1f} GB available: " + "; then ".join(parts) + " "
            "(a later group is ranked against the first group's baseline)"
        )


def fitting_groups(candidates: Sequence[Candidate], spec: ModelSpec) -> tuple[list[list[Candidate]], Groups]:
    """`candidates` (the baseline among them, or measured before) in groups that fit together."""
    needs = {c.key: need_bytes(spec, c.plan, c.stored_peak_mb) for c in candidates}
    groups = memory_groups([c.key for c in candidates], needs, "baseline", fit.available_bytes())
    by_key = {c.key: c for c in candidates}
    return [[by_key[key] for key in group] for group in groups.groups], groups


def need_bytes(spec: ModelSpec, plan: Plan, peak_mb: float = 0.0) -> int | None:
    """A candidate server's memory: the peak measured before, else the estimate; None where
    neither is known (a model whose weights cannot be counted)."""
    if peak_mb:
        return int(peak_mb * (1 << 20))
    weights = fit.weight_bytes(spec, plan)
    if weights is None:
        return None
    if plan.backend != "torch":
        return weights + ENGINE_OVERHEAD
    return weights + fit.OVERHEAD_FIXED + int(fit.OVERHEAD_SHARE * weights)


def memory_groups(keys: Sequence[str], needs: dict[str, int | None], baseline: str, available: int) -> Groups:
    """`keys` in groups whose needs fit `available` together, in their order, the baseline in the
    first; a key of unknown need is counted as the baseline's."""
    counted = {key: needs.get(key) or needs.get(baseline) or 0 for key in keys}
    base = counted.get(baseline, 0)
    left_out: dict[str, str] = {}
    groups: list[list[str]] = []
    current: list[str] = [baseline] if baseline in counted else []
    used = base
    for key in keys:
        if key == baseline:
            continue
        need = counted[key]
        if base + need > available:
            left_out[key] = (
                f"does not fit this machine's memory beside the baseline: about {need / 1e9:.1f} GB, the "
                f"baseline's {base / 1e9:.1f} GB, {available / 1e9:.1f} GB available"
            )
            continue
        if current and used + need > available:
            groups.append(current)
            current, used = [], 0
        current.append(key)
        used += need
    if current:
        groups.append(current)
    return Groups(groups=groups, left_out=left_out, needs=counted, available=available)


def memory_excess(candidate: Candidate, limit_mb: float | None, max_memory: str | None) -> str | None:
    """Why the candidate is over --max-memory (the peak RSS of its processes), or None."""
    peak = candidate.peak_rss_mb or 0.0
    if limit_mb is None or peak <= limit_mb:
        return None
    return f"peak memory {peak:.0f} MiB (its processes' RSS) over --max-memory {max_memory} ({limit_mb:.0f} MiB)"
