"""The SQLite results store: round trip, filters, concurrent writers, a killed writer, migrations."""

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from accelab.results import store as store_module
from accelab.results.result import Result
from accelab.results.store import SCHEMA_VERSION, Store


def make_result(i=0, **kw):
    base = dict(
        kind="bench",
        status="ok",
        model={"name": "minilm-l6", "task": "feature-extraction"},
        plan={"name": "baseline"},
        workload={"scenario": "forward", "batch_size": 8},
        metrics={"throughput": 100.0 + i, "latency_ms": {"p50": 10.0}},
    )
    base.update(kw)
    return Result(**base)


def test_round_trip_and_filters(tmp_path):
    store = Store(tmp_path / "r.db")
    a = make_result(1, tag="nightly")
    b = make_result(2, model={"name": "smollm2-135m", "task": "text-generation"}, group_id="g1")
    store.add(a, b)
    assert store.count() == 2
    got = store.get(a.run_id[:6])
    assert got.to_dict() == a.to_dict()
    assert [r.run_id for r in store.query(model="smollm2-135m")] == [b.run_id]
    assert [r.run_id for r in store.query(tag="nightly")] == [a.run_id]
    assert [r.run_id for r in store.query(group_id="g1")] == [b.run_id]
    with pytest.raises(ValueError, match="accelab history"):
        store.get("doesnotexist")


WRITER = textwrap.dedent(
    """
    import sys
    from accelab.results.result import Result
    from accelab.results.store import Store
    store = Store(sys.argv[1])
    for i in range(int(sys.argv[3])):
        store.add(Result(kind="bench", status="ok", model={"name": sys.argv[2]}, plan={"name": "p"},
                         workload={"scenario": "forward"}, metrics={"i": i}))
    """
)


def test_two_concurrent_writers_both_land(tmp_path):
    db = tmp_path / "r.db"
    Store(db)
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(db), name, "60"]) for name in ("writer-a", "writer-b")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    store = Store(db)
    assert len(store.query(model="writer-a")) == 60
    assert len(store.query(model="writer-b")) == 60


KILLED = textwrap.dedent(
    """
    import sqlite3, sys, time
    conn = sqlite3.connect(sys.argv[1], isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    for i in range(1000):
        conn.execute("INSERT INTO runs (run_id, created, kind, status, model, plan, doc) VALUES (?,?,?,?,?,?,?)",
                     (f"half-{i}", "2026", "bench", "ok", "m", "p", "{}"))
    print("inside", flush=True)
    time.sleep(600)
    """
)


def test_killed_writer_leaves_store_readable(tmp_path):
    db = tmp_path / "r.db"
    store = Store(db)
    kept = make_result(7)
    store.add(kept)
    proc = subprocess.Popen([sys.executable, "-c", KILLED, str(db)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "inside"  # mid-transaction, holding the write lock
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    reopened = Store(db)
    assert reopened.count() == 1  # the killed transaction rolled back
    assert reopened.get(kept.run_id).metrics == kept.metrics
    reopened.add(make_result(8))  # and the store still takes writes
    assert reopened.count() == 2


def test_migration_upgrades_older_store_in_place(tmp_path, monkeypatch):
    db = tmp_path / "r.db"
    old = Store(db)
    run = make_result(3)
    old.add(run)
    assert old.schema_version == SCHEMA_VERSION
    # a later accelab adds a column: the store must upgrade in place and keep every run
    new_migrations = [*store_module.MIGRATIONS, "ALTER TABLE runs ADD COLUMN machine TEXT"]
    monkeypatch.setattr(store_module, "MIGRATIONS", new_migrations)
    monkeypatch.setattr(store_module, "SCHEMA_VERSION", len(new_migrations))
    upgraded = Store(db)
    assert upgraded.schema_version == SCHEMA_VERSION + 1
    assert upgraded.get(run.run_id).to_dict() == run.to_dict()
    columns = [row[1] for row in sqlite3.connect(db).execute("PRAGMA table_info(runs)")]
    assert "machine" in columns


def test_store_from_newer_accelab_is_refused(tmp_path):
    db = tmp_path / "r.db"
    Store(db)
    sqlite3.connect(db).execute(f"PRAGMA user_version={SCHEMA_VERSION + 5}")
    with pytest.raises(ValueError, match="newer than this accelab"):
        Store(db)
