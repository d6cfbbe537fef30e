"""The model store: one directory per model under `models_dir()`, each with an `accelab.json`.

Layout (`ACCELAB_CACHE` moves all of it):

    models_dir()/<name>/                 a complete model (weights, config, processor files)
    models_dir()/<name>/accelab.json     its meta file, written before the directory appears
    models_dir()/.tmp-<name>+<random>/   a build in progress; a leftover one is removed by the
                                         next build of <name>
    models_dir()/.<name>.lock            taken while <name> is being built (fcntl, one host)

`accelab.json` (the same format for catalog models and for user models saved by `accelab train`):

    {"name": "digits-vit", "task": "image-classification",
     "origin": "accelab train vit-tiny on sklearn digits",   # for people
     "hub_id": null,                                         # what a user with internet would load
     "random_weights": false,
     "metrics": {"test_accuracy": 0.97},                     # free-form numbers
     "gguf_file": null,                                      # optional: a GGUF kept beside the weights
     "created": "2025-01-01T12:00:00+00:00", "accelab_version": "0.1.0"}

A model directory only becomes visible through `os.replace` of a finished temporary directory,
so an interrupted build never leaves a half-written model behind.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from accelab.catalog.entries import CATALOG
from accelab.catalog.spec import TASKS
from accelab.paths import model_dir, models_dir
from accelab.version import __version__

log = logging.getLogger(__name__)

META_FILE = "accelab.json"
_TMP_PREFIX = ".tmp-"
_TMP_SEP = "+"  # not allowed in names, so the leftovers of "vit" never match those of "vit-tiny"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def check_name(name: str) -> None:
    if not _NAME_RE.match(name):
        raise ValueError(
            f"model name {name!r} is not allowed: use letters, digits, '.', '_' or '-' "
            "(at most 100 characters, starting with a letter or digit)"
        )


def is_stored(name: str) -> bool:
    return (model_dir(name) / META_FILE).is_file()


def make_meta(
    *,
    name: str,
    task: str,
    origin: str,
    hub_id: str | None = None,
    random_weights: bool = False,
    metrics: dict | None = None,
    **extra: object,
) -> dict:
    if task not in TASKS:
        raise ValueError(f"task={task!r} is not one of {', '.join(TASKS)}")
    meta: dict[str, Any] = {
        "name": name,
        "task": task,
        "origin": origin,
        "hub_id": hub_id,
        "random_weights": random_weights,
        "metrics": dict(metrics or {}),
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "accelab_version": __version__,
    }
    meta.update(extra)
    return meta


def read_meta(directory: Path) -> dict | None:
    path = Path(directory) / META_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def write_meta(directory: Path, meta: dict) -> None:
    (Path(directory) / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def stored_models() -> dict[str, dict]:
    """name -> meta of every complete model in the store (catalog and user models)."""
    found = {}
    for path in sorted(models_dir().iterdir()):
        if path.is_dir() and not path.name.startswith("."):
            meta = read_meta(path)
            if meta is not None:
                found[path.name] = meta
    return found


@contextlib.contextmanager
def name_lock(name: str) -> Iterator[None]:
    """Serialise builds of one name across processes (a second `fetch` waits for the first)."""
    with open(models_dir() / f".{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def remove_leftovers(name: str) -> int:
    """Delete temporary directories of earlier builds of `name` that were interrupted.
    Call with `name_lock(name)` held, so that no live build is removed."""
    removed = 0
    for path in models_dir().glob(f"{_TMP_PREFIX}{name}{_TMP_SEP}*"):
        log.info("removing leftover of an interrupted build: %s", path)
        shutil.rmtree(path, ignore_errors=True)
        removed += 1
    return removed


def build_atomically(name: str, meta: dict, build: Callable[[Path], dict | None]) -> Path:
    """Run `build(tmp_dir)`, write `meta` (updated with what `build` returns) into it, then move
    it to `model_dir(name)` in one rename. An existing model of that name is replaced.
    Call with `name_lock(name)` held."""
    remove_leftovers(name)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{name}{_TMP_SEP}", dir=models_dir()))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like ~/.cache/huggingface
    try:
        extra = build(tmp)
        write_meta(tmp, {**meta, **(extra or {})})
        _replace_dir(tmp, model_dir(name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op after a successful rename
    return model_dir(name)


def _replace_dir(src: Path, dst: Path) -> None:
    # os.replace cannot replace a non-empty directory: move the old one aside first, so that
    # at every instant `dst` is either the old complete model or the new complete one.
    old = None
    if dst.exists():
        old = dst.with_name(f"{_TMP_PREFIX}{dst.name}{_TMP_SEP}old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def register_local_model(
    name: str,
    source: Path | str | Callable[[Path], object],
    *,
    task: str,
    origin: str,
    hub_id: str | None = None,
    random_weights: bool = False,
    metrics: dict | None = None,
    extra_meta: dict | None = None,
) -> Path:
    """Store a user model (e.g. one trained by `accelab train`) as `models_dir()/<name>/`.

    `source` is a directory to copy, or a function that writes the files into the directory
    it is given, e.g. `lambda d: (model.save_pretrained(d), processor.save_pretrained(d))`.
    The model is then found by `resolve(name)` and shown by `accelab models list`.
    Returns the model's directory.
    """
    check_name(name)
    if name in CATALOG:
        raise ValueError(f"model name {name!r} is a catalog entry; choose another name for your model")
    meta = make_meta(
        name=name,
        task=task,
        origin=origin,
        hub_id=hub_id,
        random_weights=random_weights,
        metrics=metrics,
        **(extra_meta or {}),
    )
    write = source if callable(source) else _copier(Path(source))

    def build(target: Path) -> None:
        write(target)  # what a writer returns is not meta

    with name_lock(name):
        return build_atomically(name, meta, build)


def _copier(source: Path) -> Callable[[Path], None]:
    if not source.is_dir():
        raise ValueError(f"model directory {source} does not exist; pass a directory with config.json")

    def copy(target: Path) -> None:
        shutil.copytree(source, target, dirs_exist_ok=True)

    return copy
