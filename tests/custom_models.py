"""Small custom models for the custom-model and Python API tests: plain nn.Modules, no transformers.

`accelab bench custom_models:build` imports this module from the tests directory (the tests run
accelab there, as a user runs it beside their own package)."""

from __future__ import annotations

import torch
from torch import nn


class TinyConvNet(nn.Module):
    """A 3-block convolutional classifier for 32x32 RGB images, 10 classes."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1, stride=2),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1, stride=2),
            nn.BatchNorm2d(64),
            nn.ReLU(),
        )
        self.head = nn.Linear(64, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images).mean(dim=(2, 3)))


class TinyEncoder(nn.Module):
    """Token ids + mask -> one 32-dimensional vector per row (mean pooled)."""

    def __init__(self, vocab: int = 100):
        super().__init__()
        self.embed = nn.Embedding(vocab, 32)
        self.mix = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = self.mix(self.embed(ids))
        weights = mask.unsqueeze(-1).float()
        return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)


def build():
    """The convnet with its example inputs and task, as a user's builder returns them."""
    import accelab

    return accelab.CustomModel(model=TinyConvNet(), inputs=torch.randn(1, 3, 32, 32), task="image-classification")


def build_bare():
    """Only the model: accelab assumes an image classifier of [B, 3, 224, 224]."""
    return TinyConvNet()


def build_encoder():
    ids = torch.randint(0, 100, (2, 12))
    return {"model": TinyEncoder(), "inputs": {"ids": ids, "mask": torch.ones_like(ids)}}


def build_nothing():
    return "not a model"
