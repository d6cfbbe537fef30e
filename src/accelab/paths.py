"""Where accelab keeps its files. `ACCELAB_CACHE` moves all of them."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "ACCELAB_CACHE"


def cache_dir() -> Path:
    """The root of accelab's cache (models, hardware figures, results store)."""
    root = os.environ.get(CACHE_ENV) or os.path.join(Path.home(), ".cache", "accelab")
    path = Path(root).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def models_dir() -> Path:
    path = cache_dir() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def default_db() -> Path:
    return cache_dir() / "results.db"
