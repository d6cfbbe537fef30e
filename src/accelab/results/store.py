"""The results store: every run appended to one SQLite file.

Writes are single transactions in WAL mode with a busy timeout, so two concurrent writers both
land and a writer killed mid-way leaves the file readable (SQLite rolls the transaction back).
The schema carries a version (PRAGMA user_version); `MIGRATIONS` upgrade an older store in place.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from accelab.paths import default_db
from accelab.results.result import Result

log = logging.getLogger(__name__)

# Migration N (1-based) brings a store at version N-1 to version N. Append, never edit.
MIGRATIONS: list[str] = [
    """
    CREATE TABLE runs (
        run_id TEXT PRIMARY KEY,
        created TEXT NOT NULL,
        kind TEXT NOT NULL,
        status TEXT NOT NULL,
        model TEXT NOT NULL,
        plan TEXT NOT NULL,
        scenario TEXT,
        tag TEXT,
        group_id TEXT,
        fingerprint TEXT,
        command TEXT,
        doc TEXT NOT NULL
    );
    CREATE INDEX runs_model ON runs(model, created);
    CREATE INDEX runs_tag ON runs(tag);
    CREATE INDEX runs_group ON runs(group_id);
    """,
]
SCHEMA_VERSION = len(MIGRATIONS)


class Store:
    def __init__(self, path: str | Path, *, timeout_s: float = 60.0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._timeout_s = timeout_s
        with self._connect() as conn:
            self._migrate(conn)

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        conn = sqlite3.connect(self.path, timeout=self._timeout_s, isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(f"PRAGMA busy_timeout={int(self._timeout_s * 1000)}")
            yield conn
        finally:
            conn.close()

    def _migrate(self, conn: sqlite3.Connection) -> None:
        conn.execute("BEGIN IMMEDIATE")  # one migrator at a time
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise ValueError(
                    f"results store {self.path} has schema version {version}, newer than this accelab "
                    f"({SCHEMA_VERSION}); upgrade accelab or pass --db with another file"
                )
            for number in range(version + 1, SCHEMA_VERSION + 1):
                log.info("migrating results store %s to schema version %d", self.path, number)
                for statement in filter(str.strip, MIGRATIONS[number - 1].split(";")):
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version={number}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    @property
    def schema_version(self) -> int:
        with self._connect() as conn:
            return conn.execute("PRAGMA user_version").fetchone()[0]

    # -- writes ---------------------------------------------------------------------------
    def add(self, *results: Result) -> None:
        rows = [_row(r) for r in results]
        with self._connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.executemany(
                    "INSERT OR REPLACE INTO runs (run_id, created, kind, status, model, plan, scenario, tag,"
                    " group_id, fingerprint, command, doc) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                    rows,
                )
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise

    # -- reads ----------------------------------------------------------------------------
    def query(
        self,
        *,
        model: str | None = None,
        kind: str | None = None,
        tag: str | None = None,
        group_id: str | None = None,
        since: str | None = None,
        limit: int | None = None,
    ) -> list[Result]:
        """Runs matching every given filter, newest first."""
        clauses, params = [], []
        for column, value in (("model", model), ("kind", kind), ("tag", tag), ("group_id", group_id)):
            if value is not None:
                clauses.append(f"{column} = ?")
                params.append(value)
        if since is not None:
            clauses.append("created >= ?")
            params.append(since)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        tail = f"LIMIT {int(limit)}" if limit else ""
        with self._connect() as conn:
            docs = conn.execute(f"SELECT doc FROM runs {where} ORDER BY created DESC, rowid DESC {tail}", params)
            return [Result.from_dict(json.loads(doc)) for (doc,) in docs.fetchall()]

    def get(self, run_id: str) -> Result:
        with self._connect() as conn:
            row = conn.execute("SELECT doc FROM runs WHERE run_id = ? OR run_id LIKE ?", (run_id, f"{run_id}%"))
            found = row.fetchall()
        if not found:
            raise ValueError(f"no run {run_id!r} in {self.path}; `accelab history` lists the runs")
        if len(found) > 1:
            raise ValueError(f"run id prefix {run_id!r} is ambiguous in {self.path}; give more characters")
        return Result.from_dict(json.loads(found[0][0]))

    def count(self) -> int:
        with self._connect() as conn:
            return conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0]


def _row(result: Result) -> tuple[Any, ...]:
    return (
        result.run_id,
        result.created,
        result.kind,
        result.status,
        result.model.get("name", ""),
        result.plan.get("name", ""),
        result.workload.get("scenario"),
        result.tag,
        result.group_id,
        result.fingerprint,
        result.command,
        result.to_json(indent=None),
    )


def open_store(path: str | Path | None = None) -> Store:
    return Store(path or default_db())


def keep(result: Result, *, json_out: str | Path | None, store: bool, db: str | Path | None) -> None:
    """What every measuring command does with its Result: the `--json` file if asked, and the
    results store unless `--no-store`."""
    if json_out:
        Path(json_out).write_text(result.to_json())
    if store:
        open_store(db).add(result)
