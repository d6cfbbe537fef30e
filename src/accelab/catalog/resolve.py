"""Resolve what the user typed (catalog name, user model, directory, .gguf, Hub id) to a ModelSpec."""

from __future__ import annotations

import difflib
import json
import logging
import os
from pathlib import Path

from accelab.catalog import custom, hub
from accelab.catalog.entries import CATALOG
from accelab.catalog.fetch import fetch as fetch_entry, is_fetched
from accelab.catalog.spec import ModelSpec, Task, check_task
from accelab.catalog.store import model_dir, read_meta, stored_models
from accelab.catalog.taskinfer import infer_task
from accelab.paths import cache_dir

log = logging.getLogger(__name__)


def resolve(
    model: str, task: str | None = None, *, fetch: bool = True, trust_remote_code: bool | None = None
) -> ModelSpec:
    """A ModelSpec for `model`, tried in this order:
    1. a catalog name (fetched first when `fetch` and not yet in the cache);
    2. a user model stored in `models_dir()/<name>/` (see `store.register_local_model`);
    3. an existing local directory (with config.json) or `.gguf` file;
    4. a custom model: `package.module:callable` returning an nn.Module (see `catalog.custom`);
    5. a Hub id (`org/name`, or `org/name@revision` to pin one), downloaded into the Hugging Face
       cache when it is not there yet (see `catalog.hub`; offline: the cache only).
    `task` overrides the task found in the meta file or inferred from config.json. A model whose
    config needs code from its repository loads only with `trust_remote_code` (default: the
    `accelab --trust-remote-code` flag).
    """
    checked = None if task is None else check_task(task)
    if model in CATALOG:
        return _from_catalog(model, checked, fetch)
    if "/" not in model and (model_dir(model) / "accelab.json").is_file():
        return _from_store(model, checked)
    path = Path(model).expanduser()
    if path.exists():
        return _from_path(model, path, checked)
    if _looks_like_path(model):
        raise ValueError(f"path {path.absolute()} does not exist (from model argument {model!r})")
    if custom.is_target(model):
        return _from_builder(model, checked)
    if (ref := hub.parse_ref(model)) is not None:
        trust = hub.trust_remote_code_default() if trust_remote_code is None else trust_remote_code
        return _from_hub(*ref, checked, trust)
    raise _unknown_name_error(model)


def _from_catalog(name: str, task: Task | None, fetch: bool) -> ModelSpec:
    entry = CATALOG[name]
    if not is_fetched(name):
        if not fetch:
            raise ValueError(f"catalog model {name!r} is not fetched yet; run `accelab models fetch {name}`")
        fetch_entry(name)
    return ModelSpec(
        name=name,
        task=task or entry.task,
        source=str(model_dir(name)),
        hub_id=entry.hub_id,
        origin=entry.origin,
        random_weights=entry.random_weights,
    )


def _from_store(name: str, task: Task | None) -> ModelSpec:
    directory = model_dir(name)
    meta = read_meta(directory) or {}
    return ModelSpec(
        name=name,
        task=task or meta["task"],
        source=str(directory),
        hub_id=meta.get("hub_id"),
        origin=meta.get("origin", ""),
        random_weights=bool(meta.get("random_weights", False)),
    )


def _from_path(model: str, path: Path, task: Task | None) -> ModelSpec:
    path = path.resolve()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(
                f"{path} is a file but not a .gguf; pass a model directory (with config.json) or a .gguf file"
            )
        # transformers loads GGUFs as causal LMs only
        return ModelSpec(
            name=model,
            task=task or "text-generation",
            source=str(path.parent),
            gguf_file=path.name,
            origin=f"local GGUF {path}",
        )
    meta = read_meta(path)
    if meta is not None:
        return ModelSpec(
            name=model,
            task=task or meta["task"],
            source=str(path),
            hub_id=meta.get("hub_id"),
            origin=meta.get("origin", f"local directory {path}"),
            random_weights=bool(meta.get("random_weights", False)),
        )
    return ModelSpec(name=model, task=task or _task_of_dir(path), source=str(path), origin=f"local directory {path}")


def _from_builder(target: str, task: Task | None) -> ModelSpec:
    found = custom.resolve_target(target, task)
    return ModelSpec(
        name=target,
        task=found.task,
        source=found.source,
        builder=found.builder,
        origin=found.origin,
    )


def from_object(
    model: object, *, inputs: object = None, task: str | None = None, labels: list[str] | None = None
) -> ModelSpec:
    """A ModelSpec for a model object in this process (the Python API): saved once, so every
    child process loads the same model (see `catalog.custom.save_object`)."""
    found = custom.save_object(model, inputs=inputs, task=task, labels=labels, directory=cache_dir() / "objects")
    name = type(model.model if isinstance(model, custom.CustomModel) else model).__name__
    return ModelSpec(
        name=name,
        task=found.task,
        source=found.source,
        builder=found.builder,
        origin=found.origin,
    )


def _task_of_dir(path: Path) -> Task:
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(f"directory {path} has no config.json; pass a Hugging Face model directory or a .gguf file")
    return infer_task(json.loads(config.read_text()))


def _from_hub(repo: str, revision: str | None, task: Task | None, trust_remote_code: bool) -> ModelSpec:
    snapshot = hub.snapshot(repo, revision)
    name = f"{repo}@{revision}" if revision else repo
    hub.check_remote_code(snapshot, name, trust_remote_code)
    log.info("resolved %s to the snapshot %s", name, snapshot)
    return ModelSpec(
        name=name,
        task=task or _task_of_dir(snapshot),
        source=str(snapshot),
        hub_id=repo,
        origin=f"Hugging Face Hub {name} ({snapshot.name})",
        trust_remote_code=trust_remote_code,
    )


def _looks_like_path(model: str) -> bool:
    name = model.split("@", 1)[0]  # a Hub revision may hold slashes: org/name@refs/pr/3
    return (
        model.startswith((".", "~", os.sep))
        or model.endswith(".gguf")
        or name.count("/") > 1
        or os.sep != "/"
        and os.sep in name
    )


def _unknown_name_error(model: str) -> ValueError:
    known = [*CATALOG, *(name for name in stored_models() if name not in CATALOG)]
    close = difflib.get_close_matches(model, known, n=3, cutoff=0.4)
    hint = f" Closest: {', '.join(close)}." if close else ""
    return ValueError(
        f"unknown model {model!r}.{hint} The catalog has: {', '.join(CATALOG)} (`accelab models list`). "
        "You can also pass a local directory, a .gguf file, a Hub id (org/name, org/name@revision) "
        "or your own model as package.module:callable."
    )
