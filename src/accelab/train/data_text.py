"""Causal-LM data: one text, tokenized once, packed into blocks of `block_size` tokens.

The last `eval_fraction` of the blocks (a contiguous tail of the text, never seen in
training) is the eval set; eval reports the perplexity over its tokens.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from accelab.train.config import TrainConfig
from accelab.train.data_spec import TrainData

log = logging.getLogger(__name__)


class BlockDataset(Dataset):
    """blocks: [N, block_size] token ids; labels are the inputs (the model shifts them)."""

    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[index], "labels": self.blocks[index]}


def read_text(config: TrainConfig) -> tuple[str, str]:
    """(text, name for the meta file)."""
    if config.dataset in ("", "heldout"):
        from accelab.catalog import inputs

        return inputs.heldout_text(), "heldout"
    path = Path(config.dataset)
    try:
        return path.read_text(encoding="utf-8"), str(path)
    except UnicodeDecodeError as err:
        raise ValueError(f"dataset {path} is not UTF-8 text ({err}); convert it, e.g. iconv -t utf-8") from None


def pack(ids: list[int], block_size: int) -> torch.Tensor:
    """[len(ids) // block_size, block_size]; the tail shorter than a block is dropped."""
    n = len(ids) // block_size
    return torch.tensor(ids[: n * block_size], dtype=torch.long).view(n, block_size)


def build_text(config: TrainConfig, tokenizer: Any) -> TrainData:
    text, name = read_text(config)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        ids = [*ids, tokenizer.eos_token_id]
    blocks = pack(ids, config.block_size)
    n_eval = max(1, round(config.eval_fraction * len(blocks)))
    n_train = len(blocks) - n_eval
    if n_train < config.batch_size:
        raise ValueError(
            f"{name} gives {len(ids)} tokens = {len(blocks)} blocks of {config.block_size}; {n_train} are for "
            f"training, fewer than one global batch (--batch-size {config.batch_size}). Lower --block-size or "
            "--batch-size, or use a longer text"
        )
    return TrainData(
        train=BlockDataset(blocks[:n_train]),
        eval=BlockDataset(blocks[n_train:]),
        class_names=None,
        eval_split=f"last {n_eval} blocks of the text",
        meta={"dataset": name, "block_size": config.block_size},
    )
