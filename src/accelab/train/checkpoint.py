"""Checkpoints: where they live, which is the latest, and whether one fits this run.

Layout of a run directory (`--output-dir`):

    <run>/checkpoints/step-0000040/   accelerate's save_state (model, optimizer, scheduler,
                                      GradScaler, RNG states of every rank) + trainer_state.json
    <run>/tensorboard/                trackers (--log-with tensorboard)
    <run>/model/                      the final model (save_pretrained + processor)
    <run>/train_config.json, train_result.json

`trainer_state.json` is written last, by the main process, after every rank has saved: a
checkpoint directory without it is incomplete (a run killed while saving) and is ignored.
Pure file logic: no torch, no accelerate.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"
_PREFIX = "step-"


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerState:
    """Where training stood when the checkpoint was written."""

    global_step: int  # optimizer steps done
    epoch: int  # the epoch in progress (0-based)
    step_in_epoch: int  # optimizer steps done within that epoch
    identity: dict[str, Any]  # model.identity(): architecture + head size
    batch_size: int  # global batch
    seed: int
    mixed_precision: str
    model: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def checkpoint_name(step: int) -> str:
    return f"{_PREFIX}{step:07d}"


def write_state(directory: Path, state: TrainerState) -> None:
    (directory / STATE_FILE).write_text(json.dumps(state.to_dict(), indent=2) + "\n")


def read_state(directory: Path) -> TrainerState:
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise ValueError(
            f"{directory} is not a complete accelab checkpoint (no {STATE_FILE}; a run may have been stopped "
            f"while saving it); pass another checkpoint, or --resume latest"
        )
    data = json.loads(path.read_text())
    known = TrainerState.__dataclass_fields__
    return TrainerState(**{k: v for k, v in data.items() if k in known})


def _step_of(path: Path) -> int | None:
    suffix = path.name[len(_PREFIX) :]
    return int(suffix) if path.name.startswith(_PREFIX) and suffix.isdecimal() else None


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """The run's complete checkpoints, oldest step first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        step = _step_of(path)
        if step is None or not path.is_dir():
            continue
        if (path / STATE_FILE).is_file():
            found.append((step, path))
        else:
            log.warning("ignoring incomplete checkpoint %s (no %s)", path, STATE_FILE)
    return [path for _, path in sorted(found)]


def latest_in(run_dirs: list[Path]) -> Path | None:
    """The newest complete checkpoint of the newest run that has one (run dirs sort by name:
    the default ones are timestamps)."""
    for run_dir in sorted(run_dirs, key=lambda p: p.name, reverse=True):
        checkpoints = complete_checkpoints(run_dir)
        if checkpoints:
            return checkpoints[-1]
    return None


def resolve_resume(resume: str, run_dirs: list[Path]) -> Path:
    """A checkpoint directory for `--resume PATH|latest`. PATH may be a checkpoint, a run
    directory (its latest checkpoint) or a run's checkpoints/ directory."""
    if resume == "latest":
        found = latest_in(run_dirs)
        if found is None:
            where = ", ".join(str(p) for p in run_dirs[:3]) or "(no earlier run)"
            raise ValueError(
                f"--resume latest: no complete checkpoint found in {where}; train without --resume "
                "first, or pass --resume PATH to a checkpoint directory"
            )
        return found
    path = Path(resume).expanduser().resolve()
    if not path.exists():
        raise ValueError(f"--resume {resume}: {path} does not exist; pass a checkpoint directory or 'latest'")
    if (path / STATE_FILE).is_file():
        return path
    run_dir = path.parent if path.name == CHECKPOINTS else path
    checkpoints = complete_checkpoints(run_dir)
    if not checkpoints:
        raise ValueError(
            f"--resume {resume}: {path} holds no complete checkpoint ({CHECKPOINTS}/step-N/ with "
            f"{STATE_FILE}); pass a checkpoint directory or 'latest'"
        )
    return checkpoints[-1]


def run_dir_of(checkpoint: Path) -> Path:
    """<run>/checkpoints/step-N -> <run>."""
    return checkpoint.parent.parent


def check_compatible(
    state: TrainerState,
    checkpoint: Path,
    *,
    identity: dict[str, Any],
    model: str,
    batch_size: int,
    seed: int,
    mixed_precision: str,
) -> list[str]:
    """ValueError when the checkpoint cannot be loaded into this run's model; warnings (returned)
    when it can but the continued run will differ from an uninterrupted one."""
    if state.identity != identity:
        differ = [k for k in identity if state.identity.get(k) != identity.get(k)]
        raise ValueError(
            f"checkpoint {checkpoint} was written for {state.model} ({_describe(state.identity)}), but this run "
            f"trains {model} ({_describe(identity)}; differs in {', '.join(differ)}). Resume with the same --model "
            "and dataset labels, or start a fresh run without --resume"
        )
    warnings = []
    for name, saved, now in (
        ("--batch-size", state.batch_size, batch_size),
        ("--seed", state.seed, seed),
        ("--mixed-precision", state.mixed_precision, mixed_precision),
    ):
        if saved != now:
            warnings.append(
                f"resuming with {name} {now} where the checkpoint used {saved}: the run will not "
                "match an uninterrupted one"
            )
    return warnings


def _describe(ident: dict[str, Any]) -> str:
    return f"{ident.get('model_type')}, {ident.get('num_labels')} labels, config {ident.get('config_sha')}"
