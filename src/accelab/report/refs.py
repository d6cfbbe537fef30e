"""REF -> Results, for `accelab regress` and `accelab report`.

A REF is, in this order of lookup:
  1. a JSON file: one Result (`accelab bench --json`), or a document with "results" (`accelab
     compare --json`, `accelab history --json`), or a list of Results;
  2. a tag (`--tag` on any command that measures): every run with that tag, newest first;
  3. a run id, or an unambiguous prefix of one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from accelab.results.result import Result
from accelab.results.store import Store


def results_from_json(doc: Any, source: str) -> list[Result]:
    if isinstance(doc, dict) and isinstance(doc.get("results"), list):
        items = doc["results"]
    elif isinstance(doc, dict) and "kind" in doc and "metrics" in doc:
        items = [doc]
    elif isinstance(doc, list):
        items = doc
    else:
        raise ValueError(
            f"{source} is not a Result JSON: expected a Result (`accelab bench --json`) or a document "
            "with a 'results' list (`accelab compare --json`)"
        )
    return [Result.from_dict(item) for item in items if isinstance(item, dict)]


def load_json_ref(path: Path) -> list[Result]:
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}); pass a file written by --json") from None
    results = results_from_json(doc, str(path))
    if not results:
        raise ValueError(f"{path} holds no Results")
    return results


def load_ref(ref: str, store: Store) -> list[Result]:
    """The runs a REF names (see the module docstring); ValueError says what was tried."""
    path = Path(ref)
    if path.suffix.lower() == ".json" or path.is_file():
        if not path.is_file():
            raise ValueError(f"no file {ref}; pass a JSON file written by --json, a tag or a run id")
        return load_json_ref(path)
    tagged = store.query(tag=ref)
    if tagged:
        return tagged
    try:
        return [store.get(ref)]
    except ValueError as err:
        if "ambiguous" in str(err):
            raise
        raise ValueError(
            f"{ref!r} is neither a JSON file, a tag nor a run id in {store.path}; "
            "`accelab history` lists the runs and their tags"
        ) from None
