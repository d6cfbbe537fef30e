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


def model_dir(name: str) -> Path:
    """Where the stored model `name` lives (see `accelab.catalog.store` for its layout)."""
    return models_dir() / name


DB_ENV = "ACCELAB_DB"


def default_db() -> Path:
    """The results store: `ACCELAB_DB`, else results.db in the cache."""
    override = os.environ.get(DB_ENV)
    return Path(override).expanduser() if override else cache_dir() / "results.db"
