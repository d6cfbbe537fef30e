"""Fetch catalog entries into the cache: idempotent, atomic, dependencies first."""

from __future__ import annotations

import difflib
import logging
import time
from collections.abc import Callable
from pathlib import Path

from accelab.catalog.entries import CATALOG, CatalogEntry
from accelab.catalog.store import build_atomically, is_stored, make_meta, model_dir, name_lock

log = logging.getLogger(__name__)

Step = Callable[[str], None]


def unknown_entry_error(name: str) -> ValueError:
    close = difflib.get_close_matches(name, CATALOG, n=3, cutoff=0.4)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    return ValueError(f"{name!r} is not in the catalog ({', '.join(CATALOG)}).{hint}")


def is_fetched(name: str) -> bool:
    return is_stored(name)


def fetch(name: str, *, force: bool = False, step: Step | None = None) -> Path:
    """Put catalog entry `name` (and the entries it requires) in the cache; return its directory.

    A second call returns at once ("already fetched"). `force` rebuilds it. The model directory
    appears in one rename once complete, so an interrupted fetch leaves nothing half-written.
    """
    entry = CATALOG.get(name)
    if entry is None:
        raise unknown_entry_error(name)
    say = _reporter(name, step)
    for required in entry.requires:
        fetch(required, step=step)
    if is_fetched(name) and not force:
        say("already fetched")
        return model_dir(name)
    with name_lock(name):
        if is_fetched(name) and not force:  # another process finished it while we waited
            say("already fetched")
            return model_dir(name)
        return _build(entry, say)


def fetch_all(*, force: bool = False, step: Step | None = None) -> dict[str, Path]:
    """Every entry but the large ones kept for benchmarks (fetched by name)."""
    return {name: fetch(name, force=force, step=step) for name, entry in CATALOG.items() if entry.in_all}


def _build(entry: CatalogEntry, say: Step) -> Path:
    start = time.perf_counter()
    meta = make_meta(
        name=entry.name,
        task=entry.task,
        origin=entry.origin,
        hub_id=entry.hub_id,
        random_weights=entry.random_weights,
        size=entry.size,
        catalog=True,
    )
    path = build_atomically(entry.name, meta, lambda target: entry.build(target, say))
    say(f"fetched into {path} in {time.perf_counter() - start:.1f} s")
    return path


def _reporter(name: str, step: Step | None) -> Step:
    def say(message: str) -> None:
        log.info("%s: %s", name, message)
        if step is not None:
            step(f"{name}: {message}")

    return say
