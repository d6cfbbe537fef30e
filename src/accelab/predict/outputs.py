"""The final output, merged from the chunk files in input order, written atomically.

Formats (by the extension of --out):
- `.jsonl`: one row per item, `{"index", "id", <prediction>}`, any task.
- `.parquet`: the same rows as a table (needs pyarrow), any task; embeddings as list<float32>.
- `.npy`: embeddings only, a float32 [N, H] matrix, with `<out>.ids.jsonl` naming each row.
Inputs that could not be used are not in the output: they are in `<out>.skipped.jsonl`
(`{"index", "id", "reason"}`). Sidecars are written first and the output last, each through a
temporary file and a rename, so an existing output is always complete.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accelab.predict.parts import Parts, sidecar_path, write_atomic

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class Merged:
    out: str
    rows: int  # predictions written
    skipped: int
    skipped_path: str | None


def merge(parts: Parts, *, total: int, out: str | Path, fmt: str) -> Merged:
    """Read every chunk file, check that each of the `total` items is there once, write the output."""
    by_index: dict[int, dict[str, Any]] = {}
    for row in parts.rows():
        if row["index"] in by_index:  # two attempts overlapped (a process of an earlier one outlived it)
            log.warning("item %s is in two chunk files; keeping the first", row["index"])
            continue
        by_index[row["index"]] = row
    missing = [i for i in range(total) if i not in by_index]
    if missing:
        raise RuntimeError(
            f"{len(missing)} item(s) have no result in {parts.dir} (first: {missing[:5]}); "
            "rerun the same command to compute them"
        )
    rows = [by_index[i] for i in range(total)]
    done = [r for r in rows if "skipped" not in r]
    skipped = [{"index": r["index"], "id": r["id"], "reason": r["skipped"]} for r in rows if "skipped" in r]
    skipped_path = sidecar_path(out, "skipped")
    if skipped:
        write_atomic(skipped_path, (json.dumps(r, ensure_ascii=False) for r in skipped))
    else:
        skipped_path.unlink(missing_ok=True)  # from an earlier run into the same --out
    WRITERS[fmt](Path(out), done)
    return Merged(
        out=str(out), rows=len(done), skipped=len(skipped), skipped_path=str(skipped_path) if skipped else None
    )


def _write_jsonl(out: Path, rows: list[dict[str, Any]]) -> None:
    write_atomic(out, (json.dumps(r, ensure_ascii=False) for r in rows))


def _write_npy(out: Path, rows: list[dict[str, Any]]) -> None:
    import numpy as np

    if rows and "embedding" not in rows[0]:
        raise ValueError(f"--out {out}: .npy holds embeddings only; use .jsonl or .parquet for this task")
    matrix = np.asarray([r["embedding"] for r in rows], dtype=np.float32)  # [N, H]
    write_atomic(sidecar_path(out, "ids"), (json.dumps({"index": r["index"], "id": r["id"]}) for r in rows))
    _replace_with(out, lambda tmp: np.save(tmp, matrix, allow_pickle=False))


def _write_parquet(out: Path, rows: list[dict[str, Any]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(rows)
    if "embedding" in table.column_names:
        column = pa.array([r["embedding"] for r in rows], type=pa.list_(pa.float32()))
        table = table.set_column(table.column_names.index("embedding"), "embedding", column)
    _replace_with(out, lambda tmp: pq.write_table(table, tmp))


def _replace_with(out: Path, write: Any) -> None:
    tmp = out.with_name(f".tmp-{os.getpid()}-{out.name}")
    try:
        with tmp.open("wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


WRITERS = {"jsonl": _write_jsonl, "npy": _write_npy, "parquet": _write_parquet}


def read_output(out: str | Path) -> list[dict[str, Any]]:
    """The rows of a finished output, whatever its format (for tests and reports)."""
    path = Path(out)
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    import numpy as np

    ids = [json.loads(line) for line in sidecar_path(path, "ids").read_text().splitlines() if line]
    matrix = np.load(path)
    return [{**meta, "embedding": vector.tolist()} for meta, vector in zip(ids, matrix)]
