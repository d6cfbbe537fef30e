"""The work directory beside the output (`results.jsonl.parts/`) that makes a run resumable.

    manifest.json                     what the rows depend on (model, plan, options, inputs) + attempts
    a001-rank0-chunk00000.jsonl       one finished chunk: a header line, then its rows by input index
    a002-rank1-chunk00003.jsonl       ... from a resumed attempt, perhaps with another process count

A chunk file appears only complete: it is written to a hidden temporary name, flushed to disk
and renamed (atomic on POSIX). Its header lists the chunk's item indices, so the done set is read
from the headers alone. Each row is `{"index": i, "id": ..., <prediction>}` or, for an input that
could not be used, `{"index": i, "id": ..., "skipped": reason}`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from accelab.predict.chunks import Chunk

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
TMP_PREFIX = ".tmp-"


def parts_path(out: str | Path) -> Path:
    return Path(f"{out}.parts")


def sidecar_path(out: str | Path, kind: str) -> Path:
    """`results.jsonl.skipped.jsonl`, `embeddings.npy.ids.jsonl`."""
    return Path(f"{out}.{kind}.jsonl")


def write_atomic(path: Path, lines: Iterable[str]) -> None:
    """Write lines to `path` so that it either does not exist or is complete."""
    tmp = path.with_name(f"{TMP_PREFIX}{os.getpid()}-{path.name}")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            for line in lines:
                f.write(line)
                f.write("\n")
            f.flush()
            os.fsync(f.fileno())  # the rename must not publish a file whose data is still in the page cache
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class Parts:
    def __init__(self, out: str | Path):
        self.dir = parts_path(out)

    def exists(self) -> bool:
        return self.dir.is_dir()

    # -- manifest -----------------------------------------------------------------------------
    def manifest(self) -> dict[str, Any] | None:
        path = self.dir / MANIFEST
        if not path.is_file():
            return None
        return json.loads(path.read_text())

    def check_compatible(self, identity: dict[str, Any]) -> None:
        """ValueError when finished chunks here came from a run whose rows would differ."""
        manifest = self.manifest()
        if manifest is None:
            return
        if manifest.get("version") != MANIFEST_VERSION:
            raise ValueError(f"{self.dir} was written by another accelab version; pass --overwrite to start over")
        old = manifest["identity"]
        changed = [
            f"{key}: {old.get(key)!r} -> {identity.get(key)!r}"
            for key in sorted(set(old) | set(identity))
            if old.get(key) != identity.get(key)
        ]
        if changed:
            raise ValueError(
                f"{self.dir} holds {len(self.done_indices())} finished item(s) of an interrupted run with other "
                f"settings ({'; '.join(changed)}); rerun with the same model, plan, inputs and options to resume "
                "it, or pass --overwrite to discard it and start over"
            )

    def begin_attempt(self, identity: dict[str, Any], details: dict[str, Any]) -> int:
        """Record a new attempt (creating the directory on the first); returns its number."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob(f"{TMP_PREFIX}*"):  # half-written by a killed process
            stale.unlink(missing_ok=True)
        manifest = self.manifest() or {"version": MANIFEST_VERSION, "identity": identity, "attempts": []}
        attempt = len(manifest["attempts"]) + 1
        manifest["attempts"].append({"attempt": attempt, **details})
        write_atomic(self.dir / MANIFEST, [json.dumps(manifest, indent=1, default=str)])
        return attempt

    # -- chunks ---------------------------------------------------------------------------------
    def chunk_files(self) -> list[Path]:
        return sorted(p for p in self.dir.glob("a*-rank*-chunk*.jsonl"))

    def write_chunk(self, chunk: Chunk, rows: list[dict[str, Any]]) -> Path:
        rows = sorted(rows, key=lambda r: r["index"])
        if [r["index"] for r in rows] != sorted(chunk.indices):  # internal invariant: every item, once
            raise AssertionError(f"chunk {chunk.name}: rows do not match its items")
        header = {"chunk": chunk.name, "indices": [r["index"] for r in rows]}
        path = self.dir / f"{chunk.name}.jsonl"
        write_atomic(path, (json.dumps(x, ensure_ascii=False) for x in [header, *rows]))
        return path

    def done_indices(self) -> set[int]:
        done: set[int] = set()
        for path in self.chunk_files():
            with path.open(encoding="utf-8") as f:
                done.update(json.loads(f.readline())["indices"])
        return done

    def rows(self) -> Iterator[dict[str, Any]]:
        for path in self.chunk_files():
            with path.open(encoding="utf-8") as f:
                f.readline()  # header
                for line in f:
                    yield json.loads(line)

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
