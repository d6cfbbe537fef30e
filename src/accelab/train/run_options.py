"""`accelab train`'s own options besides the TrainConfig it resolves: what to train, where the run
lives, and the --bench and --tune commands. Each field declares its option (accelab.options)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from accelab.options import Options, option
from accelab.train.config import CompileMode, TrainConfig

BenchRowKey = Literal["baseline", "bf16", "fp16", "accum", "ddp", "compile", "checkpointing", "workers", "fsdp"]
BENCH_ROW_KEYS: tuple[BenchRowKey, ...] = get_args(BenchRowKey)

BENCH_BUDGET_HELP = (
    "--bench: stop a row after this many seconds as too slow (its row says "
    "so). Default: only rows using a technique `accelab env` measured slower than fp32 here, after 3x the "
    "baseline row's time (at least 60 s)."
)


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainRun:
    """What `accelab train` trains, where it keeps the run, and the --bench rows; each field
    declares its option. `train.options.build_request` resolves it into a TrainConfig."""

    model: str = field(
        default="vit-tiny",
        metadata=option("Catalog name, user model or local model directory.", "--model", "-m"),
    )
    task: str | None = field(
        default=None, metadata=option("image-classification | text-generation (default: the model's).")
    )
    dataset: str | None = field(
        default=None,
        metadata=option(
            "digits (built in), a directory of class "
            "subfolders, a `datasets` dataset saved to disk, or a text file (text-generation; "
            "default: the catalog's held-out essay).",
            "--dataset",
            "-d",
        ),
    )
    plan: str | None = field(
        default=None,
        metadata=option(
            "A Plan (preset or YAML): precision *-autocast, compile, "
            "batch_size, threads, attention apply; explicit options win.",
            "--plan",
        ),
    )
    compile_mode: CompileMode = field(
        default="default",
        metadata=option("default | reduce-overhead | max-autotune | max-autotune-no-cudagraphs.", "--compile-mode"),
    )
    output_dir: Path | None = field(
        default=None,
        metadata=option(
            "Run directory (checkpoints, tensorboard, final model). Default: <cache>/runs/<name>/<time>.",
            "--output-dir",
            "-o",
        ),
    )
    resume: str | None = field(
        default=None, metadata=option("PATH to a checkpoint or run directory, or 'latest'.", "--resume")
    )
    save_as: str | None = field(
        default=None,
        metadata=option(
            "Store the trained model under this name (default <dataset>-<model>); bench, verify and serve find it.",
            "--save-as",
        ),
    )
    save: bool = field(default=True, metadata=option("Store the trained model.", "--save/--no-save"))
    bench: bool = field(
        default=False,
        metadata=option(
            "Compare baseline, bf16, fp16, accumulation, N processes, compile, activation checkpointing, "
            "loader workers and FSDP (--bench-rows picks), each step split into data / forward / backward / "
            "optimizer, with its MFU.",
            "--bench",
        ),
    )
    bench_nproc: int | None = field(
        default=None,
        metadata=option("Processes of the data-parallel bench row (default 2, or the GPU count).", "--bench-nproc"),
    )
    bench_accum: int = field(default=4, metadata=option("Micro-steps of the accumulation bench row.", "--bench-accum"))
    bench_rows: str | None = field(
        default=None,
        metadata=option(
            f"Comma-separated --bench rows of {', '.join(BENCH_ROW_KEYS)} (default all; the baseline always runs).",
            "--bench-rows",
        ),
    )
    tune: bool = field(
        default=False,
        metadata=option(
            "Choose the training plan by measurement: screen candidate plans in short interleaved runs, train "
            "the finalists and two baseline seeds, judge convergence, write the winner to --out.",
            "--tune",
        ),
    )
    out: Path = field(default=Path("train.yaml"), metadata=option("--tune: where to write the winning plan.", "--out"))
    max_memory: str | None = field(
        default=None,
        metadata=option(
            "--tune: peak memory limit (e.g. 4GiB): GPU memory per rank, or the RSS of all processes on CPU.",
            "--max-memory",
        ),
    )
    budget: str | None = field(
        default=None,
        metadata=option(
            "--tune: wall time for the whole search (e.g. 20m); the finalists' runs are shortened to fit.",
            "--budget",
        ),
    )
    tune_steps: int = field(
        default=30, metadata=option("--tune: optimizer steps of each screening run (2 warm-up).", "--tune-steps")
    )
    tune_epochs: int = field(
        default=2,
        metadata=option("--tune: epochs each finalist and baseline seed trains (convergence).", "--tune-epochs"),
    )
    tune_plans: str | None = field(
        default=None,
        metadata=option(
            "--tune: only these candidates besides the baseline, comma-separated: "
            "bf16, fp16, compile, checkpointing, workers, ddp, fsdp, batch. Default: all.",
            "--tune-plans",
        ),
    )
    finalists: int = field(
        default=3, metadata=option("--tune: plans trained to judge convergence, besides the baseline.", "--finalists")
    )
    max_seconds_per_plan: float | None = field(
        default=None, metadata=option(BENCH_BUDGET_HELP, "--max-seconds-per-plan")
    )
    timeout: float = field(default=7200.0, metadata=option("Give up on a run (or bench row) after this many seconds."))

    def __post_init__(self) -> None:
        if (self.bench or self.tune) and self.resume:
            raise ValueError("--bench and --tune measure fresh runs; drop --resume")
        if self.bench and self.tune:
            raise ValueError("--bench and --tune are two commands; pass one of them")
        if self.bench_rows is not None and not self.bench:
            raise ValueError(f"--bench-rows {self.bench_rows!r} picks rows of --bench; add --bench")
        bench_row_keys(self.bench_rows)
        for name in ("tune_steps", "tune_epochs", "finalists"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)} must be 1 or more")


def bench_row_keys(text: str | None) -> tuple[BenchRowKey, ...]:
    """--bench-rows "workers,compile" -> the rows to run, in BENCH_ROW_KEYS order, the baseline
    always among them (every other row's speed-up is over it); None: all."""
    if text is None:
        return BENCH_ROW_KEYS
    asked = {key.strip() for key in text.split(",") if key.strip()}
    unknown = sorted(asked - set(BENCH_ROW_KEYS))
    if unknown:
        raise ValueError(
            f"--bench-rows {text!r}: unknown row(s) {', '.join(unknown)}; choose from {','.join(BENCH_ROW_KEYS)}"
        )
    return tuple(key for key in BENCH_ROW_KEYS if key in asked or key == "baseline")


def explicit_fields(options: Mapping[str, Any]) -> dict[str, Any]:
    """The TrainConfig fields `accelab train`'s options (its parameters by field name) give, None
    where not given (then the plan or the task's default decides); `compile` comes from --compile /
    --no-compile with --compile-mode."""
    explicit = {f.name: options[f.name] for f, _ in Options(config=TrainConfig).declared()}
    flag = explicit["compile"]
    explicit["compile"] = None if flag is None else (options["compile_mode"] if flag else "off")
    return explicit
