"""Input sources for `accelab predict`: a folder of images, a JSONL / CSV / TXT file of texts, or a
`datasets` dataset saved to disk (`save_to_disk`).

A Source lists its items up front (ids and, for texts, the texts themselves) in a fixed,
deterministic order: every rank opens the same source and item `i` means the same thing on
all of them. Images are decoded only when `load(i)` is called (in a DataLoader worker). A bad
item (a file PIL cannot decode, a JSONL line that is not JSON, a row without text) raises
`BadItem` from `load`; the run skips and lists it, it is never fatal.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from PIL import Image

log = logging.getLogger(__name__)

ItemKind = Literal["image", "text"]
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")
TABLE_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".tsv": "tsv", ".txt": "txt"}
TEXT_FIELDS = ("text", "prompt", "sentence")  # tried in this order when --text-field is not given
ID_FIELD = "id"
FIELD_SNIFF_ROWS = 100


class BadItem(Exception):
    """One input cannot be used; the message is the reason written to the skipped sidecar."""


@dataclass(kw_only=True)
class Source:
    """Items of one input source. `ids[i]` is item i's id (relative path, `id` field or row index)."""

    path: str
    format: str  # image-folder | jsonl | csv | tsv | txt | dataset
    kind: ItemKind
    ids: list[Any]
    column: str | None = None  # the text (or image) column of a table
    texts: list[str | None] | None = None  # texts, None where the row is bad (see `errors`)
    errors: dict[int, str] = field(default_factory=dict)  # row -> why it is unusable (tables)
    files: list[Path] | None = None  # image files, absolute
    dataset: Any = None  # a datasets.Dataset with an image column
    notes: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ids)

    def load(self, index: int) -> Any:
        """Item `index`: an RGB PIL image or a str. Raises BadItem with the reason."""
        if index in self.errors:
            raise BadItem(self.errors[index])
        if self.texts is not None:
            return self.texts[index]
        if self.files is not None:
            return _open_image(self.files[index])
        return _dataset_image(self.dataset, index, self.column)

    def lengths(self) -> list[int] | None:
        """Characters per text (a proxy for tokens, known without a tokenizer), None for images."""
        if self.texts is None:
            return None
        return [len(t) if t is not None else 0 for t in self.texts]

    def digest(self) -> str:
        """A fingerprint of the item set: a resumed run checks it still reads the same inputs."""
        h = hashlib.sha256(f"{self.format}\0{self.column}\0{len(self.ids)}".encode())
        for i, item_id in enumerate(self.ids):
            h.update(f"\0{item_id}".encode())
            if self.texts is not None:
                h.update(f"\0{self.texts[i]}".encode())
            elif self.files is not None:
                h.update(f"\0{_size(self.files[i])}".encode())
        if self.dataset is not None:
            h.update(str(getattr(self.dataset, "_fingerprint", "")).encode())
        return h.hexdigest()[:16]

    def head(self, limit: int | None) -> Source:
        """The first `limit` items (all when None)."""
        if limit is None or limit >= len(self.ids):
            return self
        return Source(
            path=self.path,
            format=self.format,
            kind=self.kind,
            ids=self.ids[:limit],
            column=self.column,
            texts=None if self.texts is None else self.texts[:limit],
            errors={i: e for i, e in self.errors.items() if i < limit},
            files=None if self.files is None else self.files[:limit],
            dataset=self.dataset,
            notes=[*self.notes, f"--limit {limit}: the first {limit} of {len(self.ids)} items"],
        )


def open_source(
    path: str | Path,
    *,
    want: ItemKind,
    text_field: str | None = None,
    split: str | None = None,
    limit: int | None = None,
    taker: str = "the model",
) -> Source:
    """Open `path` as a source. `want` is what the model takes; it picks the column of a saved
    dataset and is checked against folders and files (ValueError says what to pass instead)."""
    root = Path(path).expanduser()
    if not root.exists():
        raise ValueError(f"--inputs {path}: no such file or directory")
    if root.is_dir():
        source = _open_saved_dataset(root, want, text_field, split) if _is_saved_dataset(root) else _open_folder(root)
    else:
        source = _open_table(root, text_field)
    if not len(source):
        raise ValueError(_empty_message(source))
    if source.kind != want:
        raise ValueError(_kind_mismatch(source, want, taker))
    return source.head(limit)


# -- image folders ---------------------------------------------------------------------------
def _open_folder(root: Path) -> Source:
    files, others = [], 0
    for p in sorted(root.rglob("*"), key=lambda q: q.relative_to(root).as_posix()):
        rel = p.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or not p.is_file():
            continue
        if p.suffix.lower() in IMAGE_EXTENSIONS:
            files.append(p)
        else:
            others += 1
    notes = [f"{others} file(s) under {root} are not images ({', '.join(IMAGE_EXTENSIONS)}); ignored"] if others else []
    return Source(
        path=str(root),
        format="image-folder",
        kind="image",
        files=files,
        ids=[p.relative_to(root).as_posix() for p in files],
        notes=notes,
    )


def _open_image(path: Path) -> Any:
    try:
        with Image.open(path) as image:
            return image.convert("RGB")  # forces the full decode: a truncated file fails here
    except Exception as err:  # noqa: BLE001 - PIL raises many types (UnidentifiedImageError, OSError, ...)
        raise BadItem(f"unreadable image: {type(err).__name__}: {err}") from None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


# -- tables: JSONL, CSV, TSV, TXT -------------------------------------------------------------
def _open_table(path: Path, text_field: str | None) -> Source:
    fmt = TABLE_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(
            f"--inputs {path}: unknown format {path.suffix or '(no extension)'}; give a folder of images "
            f"({', '.join(IMAGE_EXTENSIONS)}), a .jsonl/.csv/.tsv/.txt file of texts, or a `datasets` dataset "
            "saved with save_to_disk"
        )
    if fmt == "txt":
        lines: list[str | None] = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        return Source(path=str(path), format="txt", kind="text", ids=list(range(len(lines))), texts=lines)
    rows, errors = _read_jsonl(path) if fmt == "jsonl" else _read_csv(path, "\t" if fmt == "tsv" else ",")
    column = _pick_text_field(path, rows, text_field)
    return _table_source(path, fmt, rows, errors, column)


def _read_jsonl(path: Path) -> tuple[list[Any], dict[int, str]]:
    rows: list[Any] = []
    errors: dict[int, str] = {}
    with path.open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                errors[len(rows)] = f"line {len(rows) + 1} is not JSON: {err}"
                row = None
            rows.append(row)
    return rows, errors


def _read_csv(path: Path, delimiter: str) -> tuple[list[Any], dict[int, str]]:
    with path.open(encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f, delimiter=delimiter)), {}


def _pick_text_field(path: Path, rows: list[Any], text_field: str | None) -> str | None:
    """The column holding the text: --text-field, else text/prompt/sentence, else the only string
    column besides `id`. None when the rows are bare JSON strings."""
    sample = [r for r in rows[:FIELD_SNIFF_ROWS] if r is not None]
    if sample and all(isinstance(r, str) for r in sample):
        return None
    keys: dict[str, bool] = {}  # key -> seen with a string value
    for row in sample:
        if isinstance(row, dict):
            for key, value in row.items():
                keys[key] = keys.get(key, False) or isinstance(value, str)
    if text_field is not None:
        if sample and text_field not in keys:
            raise ValueError(
                f"--text-field {text_field!r} is not a column of {path}; its columns: {', '.join(keys) or '(none)'}"
            )
        return text_field
    for name in TEXT_FIELDS:
        if name in keys:
            return name
    strings = [k for k, is_str in keys.items() if is_str and k != ID_FIELD]
    if len(strings) == 1:
        return strings[0]
    if not sample:
        return None  # empty: reported as such by open_source
    raise ValueError(
        f"cannot tell which column of {path} holds the text: none is named {', '.join(TEXT_FIELDS)} and "
        f"{'several' if strings else 'no'} other string columns were found ({', '.join(keys)}); pass --text-field NAME"
    )


def _table_source(path: Path, fmt: str, rows: list[Any], errors: dict[int, str], column: str | None) -> Source:
    texts: list[str | None] = []
    ids: list[Any] = []
    errors = dict(errors)
    for i, row in enumerate(rows):
        ids.append(_row_id(row, i))
        value = row.get(column) if isinstance(row, dict) and column is not None else row
        if i in errors:
            texts.append(None)
        elif isinstance(value, str):
            texts.append(value)
        else:
            texts.append(None)
            errors[i] = (
                f"row {i} has no text in {column!r}" if column else f"row {i} is not a string"
            ) + f" (got {type(value).__name__})"
    return Source(path=str(path), format=fmt, kind="text", ids=ids, column=column, texts=texts, errors=errors)


def _row_id(row: Any, index: int) -> Any:
    if isinstance(row, dict) and row.get(ID_FIELD) not in (None, ""):
        value = row[ID_FIELD]
        return value if isinstance(value, (str, int)) else str(value)
    return index


# -- datasets saved to disk -------------------------------------------------------------------
def _is_saved_dataset(root: Path) -> bool:
    return (root / "dataset_dict.json").is_file() or (root / "state.json").is_file()


def _open_saved_dataset(root: Path, want: ItemKind, text_field: str | None, split: str | None) -> Source:
    from datasets import DatasetDict, load_from_disk

    data = load_from_disk(str(root))
    if isinstance(data, DatasetDict):
        data = _pick_split(root, data, split)
    elif split is not None:
        raise ValueError(f"--split {split}: {root} holds one dataset, not splits; drop --split")
    images = [name for name, feat in data.features.items() if type(feat).__name__ == "Image"]
    strings = [
        name
        for name, feat in data.features.items()
        if getattr(feat, "dtype", None) in ("string", "large_string") and name != ID_FIELD
    ]
    ids = (
        [v if isinstance(v, (str, int)) else str(v) for v in data[ID_FIELD]]
        if ID_FIELD in data.column_names
        else list(range(len(data)))
    )
    if want == "image" and images:
        column = text_field if text_field in images else ("image" if "image" in images else images[0])
        return Source(path=str(root), format="dataset", kind="image", ids=ids, column=column, dataset=data)
    if not strings:
        kind: ItemKind = "image" if images else "text"
        return Source(
            path=str(root),
            format="dataset",
            kind=kind,
            ids=ids if kind == "image" else [],
            column=images[0] if images else None,
            dataset=data,
        )
    column = _dataset_text_column(root, strings, text_field)
    rows = [{column: value} for value in data[column]]
    source = _table_source(root, "dataset", rows, {}, column)
    source.ids = ids
    return source


def _pick_split(root: Path, data: Any, split: str | None) -> Any:
    names = list(data.keys())
    if split is not None:
        if split not in data:
            raise ValueError(f"--split {split!r} is not in {root}; its splits: {', '.join(names)}")
        return data[split]
    if len(names) == 1:
        return data[names[0]]
    raise ValueError(f"{root} has several splits ({', '.join(names)}); pass --split NAME")


def _dataset_text_column(root: Path, strings: list[str], text_field: str | None) -> str:
    if text_field is not None:
        if text_field not in strings:
            raise ValueError(
                f"--text-field {text_field!r} is not a string column of {root}; "
                f"its string columns: {', '.join(strings)}"
            )
        return text_field
    for name in TEXT_FIELDS:
        if name in strings:
            return name
    if len(strings) == 1:
        return strings[0]
    raise ValueError(
        f"cannot tell which column of {root} holds the text ({', '.join(strings)}); pass --text-field NAME"
    )


def _dataset_image(dataset: Any, index: int, column: str | None) -> Any:
    try:
        image = dataset[index][column]
        return image.convert("RGB")
    except Exception as err:  # noqa: BLE001 - decoding by datasets + PIL: any failure means a bad item
        raise BadItem(f"unreadable image: {type(err).__name__}: {err}") from None


# -- messages ---------------------------------------------------------------------------------
def _empty_message(source: Source) -> str:
    if source.format == "image-folder":
        extra = f" ({source.notes[0]})" if source.notes else ""
        return (
            f"--inputs {source.path}: no images found{extra}; it must hold image files "
            f"({', '.join(IMAGE_EXTENSIONS)}), in subfolders or not, or be a `datasets` dataset saved to disk"
        )
    return f"--inputs {source.path}: the source has no rows; give a file with at least one text"


def _kind_mismatch(source: Source, want: ItemKind, taker: str) -> str:
    have = "images" if source.kind == "image" else "texts"
    need = "images" if want == "image" else "texts"
    fix = (
        "a folder of images (or a saved dataset with an image column)"
        if want == "image"
        else "a .jsonl/.csv/.txt file of texts (or a saved dataset with a text column)"
    )
    return f"--inputs {source.path} holds {have}, but {taker} takes {need}; give {fix}, or a model for {have}"
