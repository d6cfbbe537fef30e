"""Workload: what to run (scenario, shapes, input source). Each field `accelab bench` and
`accelab compare` set declares its option (`accelab.options`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Literal, get_args

from accelab.options import option

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

    # the option's "auto" is the model's task's choice (`benchmark.options.build_request`)
    scenario: Scenario = field(
        default="forward",
        metadata=option("forward | generate | auto (generate for generative models).", default="auto"),
    )
    batch_size: int = field(
        default=1,
        metadata=option(
            "Inputs per call. Default: the plan's batch_size, else 1; the flag wins over the plan.",
            "--batch-size",
            "-b",
            unset=True,
        ),
    )
    # text inputs are padded / truncated to exactly this length (forward)
    seq_len: int = field(default=128, metadata=option("Text length of forward inputs, in tokens."))
    # generate: min_new_tokens == max_new_tokens == new_tokens
    new_tokens: int = field(default=32, metadata=option("Tokens to generate per sequence."))
    image_size: int | None = field(default=None, metadata=option("Image side in pixels (default: the processor's)."))
    inputs: InputSource = field(
        default="real", metadata=option("real (the catalog's sample inputs) | synthetic (random, same shape).")
    )
    warmup: int = field(
        default=2, metadata=option("Untimed calls before measuring (the first call is always excluded).")
    )
    min_iters: int = field(default=5, metadata=option("Measure at least this many calls..."))
    min_seconds: float = field(default=3.0, metadata=option("...and for at least this many seconds."))
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
