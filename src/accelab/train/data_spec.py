"""What a training worker gets from its data source (`accelab.train.data` picks the source;
`data_images` and `data_text` build it): the datasets and the facts about them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

EVAL_SPLITS = ("test", "validation", "val", "valid")  # names of a held-out split, in the order tried


@dataclass(kw_only=True, slots=True)
class TrainData:
    """The datasets a worker trains and evaluates on. Items are dicts of tensors
    (`pixel_values`, `labels` or `input_ids`, `labels`), so the default collate batches them."""

    train: Any  # torch Dataset
    eval: Any
    class_names: list[str] | None  # image classification: index = label id
    eval_split: str  # for people: "digits test split", "20% held out (seed 0)", ...
    meta: dict[str, Any] = field(default_factory=dict)  # dataset facts for the model's accelab.json
    skipped: int = 0  # unreadable images left out
