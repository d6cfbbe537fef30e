"""What the training tests share (test_train_e2e.py, test_train_fsdp.py): the `accelab train` command
in-process, a tiny ViT and a private cache."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import typer
from caches import USER_CACHE, with_limits
from typer.testing import CliRunner

from accelab.train.commands import register


def invoke(*args: str):
    """`accelab train ARGS --no-progress` in-process (the workers are real child processes)."""
    app = typer.Typer()
    register(app)
    app.command("noop", hidden=True)(lambda: None)  # two commands: typer keeps `train` as a subcommand
    return CliRunner().invoke(app, ["train", *args, "--no-progress"])


def cli(*args: str):
    """`invoke`, raising on failure."""
    result = invoke(*args)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    assert result.exit_code == 0, result.output
    return result


def build_tiny_vit(path: Path, num_labels: int = 10, **shape: int) -> Path:
    """A ViT classifier of 2 layers, width 32, 16 px images (4 px patches), dropout off, seeded;
    `shape` overrides the ViTConfig sizes (hidden_size, num_hidden_layers, patch_size, ...)."""
    from transformers import ViTConfig, ViTForImageClassification

    from accelab.catalog.build_vision import image_processor_class

    labels = {i: str(i) for i in range(num_labels)}
    sizes = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "image_size": 16,
        "patch_size": 4,
        **shape,
    }
    config = ViTConfig(
        **sizes,
        num_labels=num_labels,
        id2label=labels,
        label2id={v: k for k, v in labels.items()},
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ViTForImageClassification(config).save_pretrained(path)
    image_processor_class("ViTImageProcessor")(
        size={"height": 16, "width": 16}, image_mean=[0.5] * 3, image_std=[0.5] * 3
    ).save_pretrained(path)
    return path


@contextlib.contextmanager
def private_cache(root: Path) -> Iterator[Path]:
    """ACCELAB_CACHE=root (offline) with vit-tiny (linked from the real cache, else built) and a
    tiny ViT in root/tiny-vit; the environment is restored on exit."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ACCELAB_CACHE", str(with_limits(root)))
        mp.setenv("HF_HUB_OFFLINE", "1")
        models = root / "models"
        models.mkdir()
        real = USER_CACHE / "models" / "vit-tiny"
        if (real / "accelab.json").is_file():
            os.symlink(real, models / "vit-tiny")
        else:
            from accelab.catalog.fetch import fetch

            fetch("vit-tiny")
        build_tiny_vit(root / "tiny-vit")
        yield root
