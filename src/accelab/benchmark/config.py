"""What `accelab bench` and `accelab compare` take besides the Workload (whose fields declare
their own options, `scenarios.workload`) and the Output: the model's plan(s) and the run's
limits. Each field declares its option (`accelab.options`).

bench and compare keep their own classes: their plan options mean one plan, or every plan of the
rows, and say so in their help. compare's --rounds and --sequential set RoundsConfig's fields of
their names; RoundsConfig lives in `benchmark.rounds`, which loads torch, so they are declared on
CompareRun (tests/test_command_options.py checks their defaults against RoundsConfig's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from accelab.options import Option, Options, Output, option
from accelab.scenarios.workload import Workload

PLAN_HELP = "A preset name (baseline, bf16-autocast, compile-static, int8-weight, ...) or a YAML plan file."
SET_HELP = "Override a plan field: --set batch_size=8 (repeatable)."
TASK_HELP = "Override the task inferred from the model's config."


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchRun:
    """One plan, and the run's limits."""

    task: str | None = field(default=None, metadata=option(TASK_HELP))
    plan: str = field(default="baseline", metadata=option(PLAN_HELP, "--plan"))
    set_: list[str] = field(default_factory=list, metadata=option(SET_HELP, "--set"))
    threads: int | None = field(default=None, metadata=option("Intra-op threads (sets the plan's threads field)."))
    device: str | None = field(default=None, metadata=option("cpu | cuda | cuda:N (default: CUDA when present)."))
    timeout: float = field(default=1800.0, metadata=option("Give up on the run after this many seconds."))


@dataclass(frozen=True, kw_only=True, slots=True)
class CompareRun:
    """The plans of the rows, the quality guard, the limits of each plan, and the tables' files."""

    plans: str = field(
        default="baseline,bf16-autocast,compile",
        metadata=option("Comma-separated presets or YAML files; the first is the reference row.", "--plans"),
    )
    task: str | None = field(default=None, metadata=option(TASK_HELP))
    set_: list[str] = field(
        default_factory=list, metadata=option("Override a field in every plan: --set batch_size=8.", "--set")
    )
    threads: int | None = field(default=None, metadata=option("Intra-op threads for every plan."))
    device: str | None = field(default=None, metadata=option("cpu | cuda | cuda:N."))
    quality: bool = field(
        default=True,
        metadata=option("Verify every row against the fp32 eager reference.", "--quality/--no-quality"),
    )
    samples: int | None = field(
        default=None,
        metadata=option(
            "Inputs compared by the quality guard (generation: also 2 text windows each). Default per task, as "
            "verify's: 128 images, 32 sentences, 16 prompts."
        ),
    )
    tolerance: str = field(
        default="balanced", metadata=option("strict | balanced | loose, optionally with metric=value overrides.")
    )
    timeout: float = field(
        default=1800.0, metadata=option("Per-plan time limit in seconds (a plan past it is an error).")
    )
    max_seconds_per_plan: float | None = field(
        default=None,
        metadata=option(
            "Stop a plan after this many seconds as too slow (its row says so). "
            "Default: only plans using a technique `accelab env` measured slower than fp32 here, after 3x the "
            "first plan's time (at least 60 s).",
            "--max-seconds-per-plan",
        ),
    )
    rounds: int = field(  # RoundsConfig.rounds
        default=6,
        metadata=option(
            "Turns per plan: the plans run in alternating short rounds "
            "(A B ... B A) and share --min-seconds / --min-iters among them.",
            "--rounds",
        ),
    )
    sequential: bool = field(  # RoundsConfig.sequential
        default=False,
        metadata=option(
            "One plan at a time, each alone in memory (for "
            "models too big to hold several copies); speed-ups are then unpaired, and a "
            "busy minute can hit one plan only: the noise column says so.",
            "--sequential",
        ),
    )
    csv_out: Path | None = field(default=None, metadata=option(None, "--csv"))
    markdown_out: Path | None = field(default=None, metadata=option(None, "--markdown"))

    def __post_init__(self) -> None:
        if not self.plan_names:
            raise ValueError("--plans is empty; give e.g. --plans baseline,compile")

    @property
    def plan_names(self) -> list[str]:
        return [p.strip() for p in self.plans.split(",") if p.strip()]


# compare's --batch-size is the rows' shared batch (default 1), not one plan's
COMPARE_WORKLOAD = Options(
    config=Workload,
    declare={
        "batch_size": Option(
            help="Inputs per call for every plan that sets no batch_size; a plan's own wins "
            "(baseline[batch_size=16], a tuned plan file, --set batch_size=N).",
            flags=("--batch-size", "-b"),
        )
    },
)
COMPARE_OUTPUT = Options(
    config=Output, declare={"json_out": Option(help="Write the rows and Results as JSON.", flags=("--json",))}
)
