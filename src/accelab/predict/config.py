"""PredictConfig: everything one batch-inference run needs, checked, JSON round-trip.

It crosses a process boundary: `accelab predict` (the parent) resolves the model, the plan and
the source, writes this as JSON, and every rank (`python -m accelab.predict.worker CONFIG`,
under torchrun when there are several) reads it back. No I/O happens here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args

from accelab.options import option

OutputFormat = Literal["jsonl", "npy", "parquet"]
OUTPUT_FORMATS: tuple[OutputFormat, ...] = get_args(OutputFormat)
DeviceChoice = str  # "auto" | "cpu" | "cuda" | "cuda:N"

CHUNK_HELP = "Items per resumable chunk (default 8 batches); an interrupted run redoes at most one chunk per process."
WORKERS_HELP = "DataLoader workers per process for decoding and preprocessing (default: min(4, CPUs per process - 1))."
# Batch size when neither --batch-size nor the plan sets one: encoders and classifiers run one
# forward per batch; generation holds a KV cache per row and decodes token by token.
DEFAULT_BATCH = {"image-classification": 32, "feature-extraction": 32, "text-generation": 8, "image-text-to-text": 8}
BATCHES_PER_CHUNK = 8  # default resume granularity: at most this many batches per rank are redone
MIN_CHUNKS = 16  # small inputs get smaller chunks, so that ranks get similar shares


@dataclass(frozen=True, kw_only=True, slots=True)
class PredictRun:
    """What `accelab predict MODEL` runs over, and with what plan; each field declares its option.
    `predict.options.build_request` resolves it into a PredictConfig."""

    inputs: str = field(
        metadata=option(
            "A folder of images (searched recursively), a .jsonl/.csv/"
            ".tsv/.txt file of texts or prompts, or a `datasets` dataset saved with save_to_disk.",
            "--inputs",
            "-i",
        )
    )
    out: Path = field(
        metadata=option(
            "results.jsonl (any task), results.parquet (any task) or "
            "embeddings.npy (feature extraction; ids in embeddings.npy.ids.jsonl).",
            "--out",
            "-o",
        )
    )
    task: str | None = field(default=None, metadata=option("Override the task inferred from the model."))
    plan: str = field(
        default="baseline",
        metadata=option(
            "A preset name (baseline, bf16-autocast, compile, int8-weight, ...) or a YAML plan file.", "--plan"
        ),
    )
    overrides: list[str] = field(
        default_factory=list, metadata=option("Override a plan field: --set precision=bf16-autocast.", "--set")
    )
    threads: int | None = field(
        default=None, metadata=option("Intra-op threads per process (default: CPUs / processes).")
    )
    overwrite: bool = field(
        default=False,
        metadata=option(
            "Replace an existing output, or discard an interrupted run's finished chunks instead of resuming.",
            "--overwrite",
        ),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class PredictConfig:
    """One `accelab predict` run. `spec` and `plan` are ModelSpec / Plan dicts (resolved by the
    parent); `source_items` and `source_digest` pin the input set the parent saw."""

    spec: dict[str, Any]
    plan: dict[str, Any]
    source: str
    out: str
    task: str
    source_items: int
    source_digest: str
    text_field: str | None = field(
        default=None,
        metadata=option(
            "Column with the text (default: text, prompt, sentence, or the only string column).", "--text-field"
        ),
    )
    split: str | None = field(default=None, metadata=option("Split of a saved DatasetDict.", "--split"))
    limit: int | None = field(default=None, metadata=option("Only the first N inputs.", "--limit"))
    top_k: int = field(default=5, metadata=option("Labels per image (classification).", "--top-k"))
    max_length: int | None = field(
        default=None,
        metadata=option("Truncate texts to this many tokens (default: the model's limit).", "--max-length"),
    )
    max_new_tokens: int = field(
        default=32, metadata=option("Tokens to generate per input (greedy).", "--max-new-tokens")
    )
    prompt: str = field(
        default="Describe the image.",
        metadata=option("The question asked about each image (vision-language models).", "--prompt"),
    )
    batch_size: int = field(
        default=32,
        metadata=option(
            "Per process (default: the plan's, else 32, or 8 for generation).", "--batch-size", "-b", unset=True
        ),
    )
    chunk_size: int = field(default=256, metadata=option(CHUNK_HELP, "--chunk-size", unset=True))
    workers: int = field(default=0, metadata=option(WORKERS_HELP, "--workers", unset=True))
    device: DeviceChoice = field(
        default="auto", metadata=option("auto | cpu | cuda | cuda:N (several processes: one GPU each).")
    )
    world_size: int = 1  # processes in all, over every node
    progress: bool = field(default=True, metadata=option(None, "--progress/--no-progress"))
    timeout_s: float = field(
        default=86400.0, metadata=option("Give up after this many seconds (finished chunks are kept).", "--timeout")
    )
    summary_path: str | None = None  # where global rank 0 writes the run's summary (JSON)

    def __post_init__(self) -> None:
        for name in ("batch_size", "chunk_size", "top_k", "max_new_tokens", "world_size", "source_items"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"--{name.replace('_', '-')} {value} is out of range: it must be 1 or more")
        if self.workers < 0:
            raise ValueError(f"--workers {self.workers} is out of range: 0 (decode in the main process) or more")
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"--max-length {self.max_length} is out of range: it must be 1 or more")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit {self.limit} is out of range: it must be 1 or more")
        if self.timeout_s <= 0:
            raise ValueError(f"--timeout {self.timeout_s} must be more than 0 seconds")
        output_format(self.out)  # raises for an unknown extension

    @property
    def output_format(self) -> OutputFormat:
        return output_format(self.out)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PredictConfig:
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(
                f"unknown PredictConfig field(s) {sorted(unknown)}; was the file written by another accelab version?"
            )
        return cls(**data)

    def with_changes(self, **changes: Any) -> PredictConfig:
        return dataclasses.replace(self, **changes)

    def identity(self) -> dict[str, Any]:
        """What decides the output's content. A resumed run must match it exactly; batch size,
        processes, workers and chunking only change how fast the same rows come out."""
        plan = {k: v for k, v in self.plan.items() if k not in ("name", "batch_size", "threads", "interop_threads")}
        return {
            "model": {
                "name": self.spec.get("name"),
                "source": self.spec.get("source"),
                "gguf_file": self.spec.get("gguf_file"),
            },
            "task": self.task,
            "plan": plan,
            "source": self.source,
            "split": self.split,
            "text_field": self.text_field,
            "items": self.source_items,
            "digest": self.source_digest,
            "options": task_options(self),
        }


def task_options(config: PredictConfig) -> dict[str, Any]:
    """The options of `config.task` (the others do not apply to it)."""
    if config.task == "image-classification":
        return {"top_k": config.top_k}
    if config.task == "feature-extraction":
        return {"max_length": config.max_length}
    if config.task == "text-generation":
        return {"max_new_tokens": config.max_new_tokens, "max_length": config.max_length}
    return {"max_new_tokens": config.max_new_tokens, "prompt": config.prompt}


def output_format(out: str | Path) -> OutputFormat:
    suffix = Path(out).suffix.lower().lstrip(".")
    for known in OUTPUT_FORMATS:
        if suffix == known:
            return known
    raise ValueError(
        f"--out {out}: unknown output format {('.' + suffix) if suffix else '(no extension)'}; "
        "end the name in .jsonl (any task), .parquet (any task) or .npy (embeddings)"
    )


def default_chunk_size(batch_size: int, items: int) -> int:
    """8 batches, or fewer for small inputs (at least MIN_CHUNKS chunks, to deal out evenly).
    It does not depend on the process count: the same batches run whatever the nproc."""
    return min(batch_size * BATCHES_PER_CHUNK, max(1, -(-items // MIN_CHUNKS)))


def default_workers(cpus: int, local_processes: int) -> int:
    """DataLoader workers per process: the CPUs each process gets, less the one running the model,
    at most 4 (decoding rarely needs more to keep one model busy). 0 decodes in the main process."""
    return max(0, min(4, cpus // max(1, local_processes) - 1))
