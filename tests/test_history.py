"""`accelab history`: --since parsing, rows, CSV / JSON export, filters through the CLI.
Results are SYNTHETIC (tests/test_report_helpers.py)."""

import csv
import datetime as dt
import io
import json

import pytest
import typer
from test_report_helpers import FINGERPRINT, bench, loadtest, train
from typer.testing import CliRunner

from accelab.report import commands, history
from accelab.report.refs import results_from_json
from accelab.results.store import Store


def cli() -> typer.Typer:
    app = typer.Typer()
    commands.register(app)
    return app


def run(*args: str):
    return CliRunner().invoke(cli(), list(args), env={"COLUMNS": "200"})


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "r.db")
    s.add(
        bench(batch=1, p50=3.0, created="2026-11-01T10:00:00+00:00", tag="main"),
        bench(batch=8, p50=10.0, quality="pass", created="2026-11-20T10:00:00+00:00", kind="compare", group_id="g1"),
        train(created="2026-11-21T10:00:00+00:00"),
        loadtest(created="2026-11-22T10:00:00+00:00"),
    )
    return s


def test_parse_since_dates_and_ages():
    now = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.timezone.utc)
    assert history.parse_since("2026-11-01", now) == "2026-11-01T00:00:00+00:00"
    assert history.parse_since("7d", now) == "2026-11-23T12:00:00+00:00"
    assert history.parse_since("12h", now) == "2026-11-30T00:00:00+00:00"
    assert history.parse_since("2w", now) == "2026-11-16T12:00:00+00:00"
    with pytest.raises(ValueError, match="--since 'yesterday' is neither a date nor an age"):
        history.parse_since("yesterday", now)


def test_rows_carry_numbers_and_the_key_metric():
    r = bench(batch=8, p50=10.0, quality="pass")
    row = history.row(r)
    assert row["latency_p50_ms"] == 10.0 and row["throughput"] == pytest.approx(800.0)
    assert row["key_metric"] == "p50 10 ms · 800 items/s · quality pass"
    assert row["fingerprint"] == FINGERPRINT and row["batch_size"] == 8
    assert history.row(train())["key_metric"] == "100 samples/s · epoch 12 s · accuracy 85.2%"
    assert history.row(loadtest())["key_metric"] == "p50 60 ms · 10 req/s · max 10 req/s under SLO"
    failed = bench(status="error", reason="RuntimeError: boom\ntraceback...", metrics={})
    assert history.row(failed)["key_metric"] == "error: RuntimeError: boom"


def test_csv_and_json_exports_round_trip():
    results = [bench(), train()]
    rows = list(csv.DictReader(io.StringIO(history.to_csv(results))))
    assert [r["kind"] for r in rows] == ["bench", "train"] and rows[0]["latency_p50_ms"] == "10.0"
    doc = json.loads(history.to_json(results))
    assert [r.run_id for r in results_from_json(doc, "x")] == [r.run_id for r in results]  # a REF for regress


def test_history_command_lists_filters_and_exports(store, tmp_path):
    result = run("history", "--db", str(store.path))
    assert result.exit_code == 0, result.output
    for text in ("bench", "compare", "train", "loadtest", "p50 10 ms", "quality pass", FINGERPRINT):
        assert text in result.output

    result = run("history", "--db", str(store.path), "--kind", "train")
    assert "train" in result.output and "loadtest" not in result.output

    result = run("history", "minilm-l6", "--db", str(store.path), "--since", "2026-11-10")
    assert "compare" in result.output and "main" not in result.output  # the 11-01 run (tag main) is older

    csv_file, json_file = tmp_path / "h.csv", tmp_path / "h.json"
    result = run("history", "--db", str(store.path), "--tag", "main", "--csv", str(csv_file), "--json", str(json_file))
    assert result.exit_code == 0
    assert [r["tag"] for r in csv.DictReader(csv_file.open())] == ["main"]
    assert len(json.loads(json_file.read_text())["results"]) == 1


def test_history_command_on_an_empty_selection(store):
    result = run("history", "--db", str(store.path), "--tag", "nope")
    assert result.exit_code == 0 and "no runs in" in result.output and "tag=nope" in result.output


def test_history_warns_when_several_machines_are_listed(store):
    from test_report_helpers import OTHER_ENV, OTHER_FINGERPRINT

    store.add(bench(environment=OTHER_ENV, fingerprint=OTHER_FINGERPRINT))
    result = run("history", "--db", str(store.path))
    assert "results from different machines are not compared as equals" in result.output
