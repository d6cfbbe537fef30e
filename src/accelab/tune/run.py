"""A whole tune: space, search, winner Plan, table, Pareto chart, store."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console

from accelab.catalog.spec import ModelSpec
from accelab.plan.plan import Plan
from accelab.plan.presets import PRESETS
from accelab.quality.collect import QualityConfig
from accelab.results.store import Store
from accelab.scenarios.workload import Workload
from accelab.tune.measure import BenchMeasurer
from accelab.tune.search import Constraints, Goal, Search, SearchLog
from accelab.tune.space import Space

_SIZE = re.compile(r"^\s*([\d.]+)\s*(b|kb|kib|mb|mib|gb|gib|tb|tib)?\s*$", re.I)
_UNITS = {None: 1 / 2**20, "b": 1 / 2**20, "kb": 1e3 / 2**20, "kib": 1 / 1024, "mb": 1e6 / 2**20, "mib": 1.0,
          "gb": 1e9 / 2**20, "gib": 1024.0, "tb": 1e12 / 2**20, "tib": 2**20}


def parse_memory_mb(text: str) -> float:
    """"2GiB", "1500MB", "800MiB" -> MiB (what peak_memory_mb reports)."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"--max-memory {text!r} must be a size like 2GiB or 1500MB")
    unit = match.group(2).lower() if match.group(2) else None
    if unit is None:
        raise ValueError(f"--max-memory {text!r} needs a unit: e.g. {text}MiB or {text}GiB")
    return float(match.group(1)) * _UNITS[unit]


def parse_duration_s(text: str) -> float:
    """"90s", "10m", "1h", "300" -> seconds."""
    match = re.match(r"^\s*([\d.]+)\s*(s|m|h)?\s*$", text)
    if not match:
        raise ValueError(f"--budget {text!r} must be a duration like 600s, 10m or 1h")
    return float(match.group(1)) * {"s": 1, "m": 60, "h": 3600, None: 1}[match.group(2)]


@dataclass(frozen=True, kw_only=True, slots=True)
class TuneSetup:
    spec: ModelSpec
    workload: Workload
    space: Space
    goal: Goal
    constraints: Constraints
    screen_batch: int
    tolerance: str
    budget_s: float | None


def tune_id(setup: TuneSetup) -> str:
    """Same model, workload, space, goal and limits -> same id, so a rerun resumes."""
    blob = json.dumps(
        [setup.spec.to_dict(), setup.workload.to_dict(), setup.space.variants, setup.space.batch_sizes,
         setup.goal, asdict(setup.constraints), setup.screen_batch, setup.tolerance],
        sort_keys=True, default=str,
    )
    return "tune-" + hashlib.sha256(blob.encode()).hexdigest()[:12]


def run_tune(
    setup: TuneSetup, *, store: Store | None, device: str | None, fresh: bool, console: Console,
    quality_samples: int = 8,
) -> tuple[SearchLog, BenchMeasurer, str]:
    group = tune_id(setup)
    quality = None
    if setup.constraints.quality != "off":
        quality = QualityConfig(samples=quality_samples, new_tokens=min(setup.workload.new_tokens, 16), batch_size=8)
    measurer = BenchMeasurer(
        spec=setup.spec, workload=setup.workload, device=device, store=store, group_id=group, quality=quality,
        tolerance=setup.tolerance, screen_seconds=min(setup.workload.min_seconds, 1.0),
        final_seconds=setup.workload.min_seconds, console=console,
    )
    if not fresh:
        found = measurer.load_replay()
        if found:
            console.print(f"resuming tune {group}: {found} earlier measurements in the store will be reused")
    search = Search(
        variants=setup.space.variants, batch_sizes=setup.space.batch_sizes, measure=measurer,
        constraints=setup.constraints, goal=setup.goal, screen_batch=setup.screen_batch, budget_s=setup.budget_s,
    )
    return search.run(), measurer, group


def winning_plan(log: SearchLog, group: str) -> Plan | None:
    if log.winner is None:
        return None
    c = log.winner.candidate
    return PRESETS[c.variant].with_changes(name=f"tuned-{c.variant}-b{c.batch_size}", batch_size=c.batch_size)


def write_plan(plan: Plan, path: Path, header: str) -> None:
    path.write_text("".join(f"# {line}\n" for line in header.splitlines()) + plan.to_yaml())
