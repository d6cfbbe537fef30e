"""Result: one measured run. Measurements + environment + ModelSpec + Plan + Workload + quality."""

from __future__ import annotations

import datetime as dt
import json
import shlex
import sys
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

# "stopped": ran past its time budget as too slow (an answer, like "unsupported", not a failure)
ResultStatus = Literal["ok", "unsupported", "stopped", "error", "oom", "timeout", "crashed"]


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def command_line() -> str:
    """The command line that reproduces this run."""
    argv = list(sys.argv)
    # `accelab ...`, `python -m accelab ...` (argv[0] is then .../accelab/__main__.py) and the
    # `python -m accelab.serve`-style entries all reproduce as the `accelab` command
    if argv and (argv[0].endswith(("/accelab", "accelab")) or argv[0].endswith("/accelab/__main__.py")):
        argv[0] = "accelab"
    return shlex.join(argv)


@dataclass(kw_only=True, slots=True)
class Result:
    kind: str  # bench | compare | verify | tune | train | loadtest | predict | ...
    status: ResultStatus
    model: dict[str, Any]
    plan: dict[str, Any]
    workload: dict[str, Any]
    metrics: dict[str, Any] = field(default_factory=dict)
    quality: dict[str, Any] | None = None
    environment: dict[str, Any] = field(default_factory=dict)
    fingerprint: str = ""
    reason: str | None = None  # why it is not "ok": unsupported here, the error, the timeout
    notes: list[str] = field(default_factory=list)
    command: str = ""
    tag: str | None = None
    group_id: str | None = None  # the compare / tune / train-bench run this row belongs to
    run_id: str = field(default_factory=new_run_id)
    created: str = field(default_factory=now_iso)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=str)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Result:
        known = {name for name in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})
