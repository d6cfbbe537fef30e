"""Workload: what to run (scenario, shapes, input source)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    from accelab.plan.plan import Plan

Scenario = Literal["forward", "generate", "train-step"]
InputSource = Literal["real", "synthetic"]


def _check_choice(field: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{field}={value!r} is not allowed; choose one of: {', '.join(map(str, allowed))}")


def _check_min(field: str, value: int | float, minimum: int | float, hint: str = "") -> None:
    if value < minimum:
        raise ValueError(f"{field}={value} is out of range: it must be >= {minimum}{hint}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """Shapes and scenario of one measurement. `batch_size` is final: the command chose it with
    `resolve_batch_size`, and nothing downstream reads the Plan's batch_size again."""

    scenario: Scenario = "forward"
    batch_size: int = 1
    seq_len: int = 128  # text inputs are padded / truncated to exactly this length (forward)
    new_tokens: int = 32  # generate: min_new_tokens == max_new_tokens == new_tokens
    image_size: int | None = None  # None: the processor's own size
    inputs: InputSource = "real"
    warmup: int = 2
    min_iters: int = 5
    min_seconds: float = 3.0
    max_seconds: float = 120.0  # a loop stops here even if min_iters is not reached

    def __post_init__(self) -> None:
        _check_choice("scenario", self.scenario, get_args(Scenario))
        _check_choice("inputs", self.inputs, get_args(InputSource))
        _check_min("batch_size", self.batch_size, 1, "; pass --batch-size 1 or more")
        _check_min("seq_len", self.seq_len, 1, "; pass --seq-len 1 or more")
        _check_min("new_tokens", self.new_tokens, 1, "; pass --new-tokens 1 or more")
        if self.image_size is not None:
            _check_min("image_size", self.image_size, 8, "; pass --image-size 8 or more")
        _check_min("warmup", self.warmup, 0)
        _check_min("min_iters", self.min_iters, 1)
        _check_min("min_seconds", self.min_seconds, 0)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Workload:
        return cls(**data)


@dataclass(frozen=True, kw_only=True, slots=True)
class RoundSpec:
    """How long one round runs: until both min_iters and min_seconds, or max_seconds."""

    min_iters: int
    min_seconds: float
    max_seconds: float

    @classmethod
    def whole(cls, workload: Workload) -> RoundSpec:
        return cls(min_iters=workload.min_iters, min_seconds=workload.min_seconds, max_seconds=workload.max_seconds)


def resolve_batch_size(flag: int | None, plan: Plan | None, default: int) -> int:
    """The batch size of a run, by the one rule every command applies where it builds its
    request: an explicit --batch-size, else the plan's batch_size (plan files from `accelab tune`
    carry one), else the command's default.

    compare passes no flag and its --batch-size as the default, once per plan: each plan's own
    batch_size (`baseline[batch_size=16]`) wins over the batch shared by the rows. train applies
    the same order to every option it takes from a plan (`accelab.train.options.merge`)."""
    if flag is not None:
        return flag
    if plan is not None and plan.batch_size is not None:
        return plan.batch_size
    return default
