"""End to end on real measurements: MiniLM-L6 benched by the real engine (own child process each).

  main     plan "baseline", threads=2, batch 8     the reference
  pr-slow  plan "baseline", threads=1, batch 8     deliberately slowed: must fail `accelab regress`
  pr-same  plan "baseline", threads=2, batch 8     a repeat of main: must pass
  b1       plan "baseline", threads=2, batch 1     a second batch size for the report's curves

The store also gets SYNTHETIC Results (tests/test_report_helpers.py, each noted as such) for the
kinds whose engines are not written yet (train, loadtest, tune), so that every report section
is drawn. About 90 s on a quiet 2-core CPU. On a machine shared with other jobs the thread
comparison is measured twice; if it is still inconclusive and the runs show why (threads=2 no
faster than threads=1, or a per-call cv above 15 %), the two regress tests skip with the numbers.
"""

from __future__ import annotations

import os
import shutil

import pytest
import typer
from test_report import ALL_SECTIONS, _screenshot_module, assert_self_contained, png_payloads
from test_report_helpers import SYNTHETIC_NOTE, loadtest, train, tune_group
from typer.testing import CliRunner

from accelab.report import commands
from accelab.report.regress import compare
from accelab.results.store import Store

pytestmark = pytest.mark.slow
ATTEMPTS = 2  # a busy shared machine may slow one run as a whole: measure once more before failing


def run(*args: str):
    app = typer.Typer()
    commands.register(app)
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


def measure(threads: int, batch_size: int, tag: str):
    from accelab.bench.engine import bench
    from accelab.catalog.resolve import resolve
    from accelab.plan.plan import Plan
    from accelab.scenarios.workload import Workload

    workload = Workload(scenario="forward", batch_size=batch_size, seq_len=128, min_iters=10,
                        min_seconds=2 if batch_size > 1 else 1)
    result = bench(resolve("minilm-l6"), Plan(name="baseline", threads=threads), workload, tag=tag, timeout_s=600)
    assert result.ok, f"{result.status}: {result.reason}\n{result.metrics.get('traceback', '')}"
    return result


def conclusive(runs: dict) -> bool:
    return not compare([runs["main"]], [runs["pr-same"]]).regressed and compare([runs["main"]], [runs["pr-slow"]]).regressed


def busy(runs: dict) -> str | None:
    """Why the machine could not measure a thread-count change, from the runs themselves; None if it could."""
    p50 = {tag: r.metrics["latency_ms"]["p50"] for tag, r in runs.items()}
    cv = max(r.metrics["latency_ms"]["cv"] for r in runs.values())
    if p50["main"] < p50["pr-slow"] and cv <= 0.15:
        return None
    return (f"the machine was too busy to measure threads: threads=2 p50 {p50['main']:.0f} ms vs threads=1 "
            f"{p50['pr-slow']:.0f} ms, per-call cv up to {cv:.0%}, load average {os.getloadavg()[0]:.1f} on "
            f"{os.cpu_count()} cores (other jobs running at the same time)")


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    store = Store(tmp_path_factory.mktemp("e2e") / "results.db")
    for _ in range(ATTEMPTS):
        # interleaved, so that a drift of the machine over the minute hits both plans alike
        runs = {"main": measure(2, 8, "main"), "pr-slow": measure(1, 8, "pr-slow"), "pr-same": measure(2, 8, "pr-same")}
        if conclusive(runs):
            break
    why_busy = busy(runs)
    runs["b1"] = measure(2, 1, "b1")
    store.add(*runs.values())
    synthetic = [train(), train("bf16", speed=1.6, decay=0.96), loadtest(), *tune_group()]
    for i, r in enumerate(synthetic):  # older than the real runs: `--last N` means the real ones
        r.created = f"2026-01-01T00:00:{i:02d}+00:00"
    store.add(*synthetic)
    return store, runs, synthetic, why_busy


def test_real_runs_carry_what_the_report_and_regress_read(real):
    _, runs, _, _ = real
    for r in runs.values():
        assert r.fingerprint and r.environment.get("cpu_model")
        assert r.metrics["latency_ms"]["n"] >= 10 and r.metrics["throughput"] > 0 and r.metrics["peak_memory_mb"] > 0
    assert runs["pr-slow"].metrics["threads"]["intra_op"] == 1 and runs["main"].metrics["threads"]["intra_op"] == 2


def test_regress_passes_a_repeat_of_the_same_plan(real):
    store, runs, _, why_busy = real
    result = run("regress", "--baseline", "main", "--candidate", "pr-same", "--db", str(store.path))
    if result.exit_code != 0 and why_busy:
        pytest.skip(why_busy)
    assert result.exit_code == 0, result.output
    assert "no regression" in result.output


def test_regress_fails_the_slowed_plan(real):
    store, runs, _, why_busy = real
    result = run("regress", "--baseline", "main", "--candidate", "pr-slow", "--db", str(store.path))
    if result.exit_code != 1 and why_busy:
        pytest.skip(why_busy)
    assert result.exit_code == 1, result.output
    assert "plans differ: threads 2 -> 1" in result.output
    (pair,) = compare([runs["main"]], [runs["pr-slow"]]).pairs
    verdicts = {c.metric: c.verdict for c in pair.checks}
    assert verdicts["p50"] == "REGRESSION" and verdicts["throughput"] == "REGRESSION"
    p50 = next(c for c in pair.checks if c.metric == "p50")
    assert p50.change > p50.limit >= 0.05  # the slowdown exceeds both the threshold and the noise


def test_report_on_real_runs_is_self_contained_with_plots(real, tmp_path):
    store, runs, synthetic, _ = real
    by_kind = {r.kind: r for r in synthetic}
    out = tmp_path / "r.html"
    result = run("report", "--last", "4", "--group", "tune01", "--run", by_kind["train"].run_id,
                 "--run", by_kind["loadtest"].run_id, "--out", str(out), "--db", str(store.path))
    assert result.exit_code == 0, result.output
    page = out.read_text()
    assert_self_contained(page)
    for section in ALL_SECTIONS:
        assert f'<section id="{section}">' in page, section
    assert len(png_payloads(page)) >= 7
    real_env = runs["main"].environment
    assert runs["main"].fingerprint in page and real_env["cpu_model"] in page
    assert all(r.run_id in page for r in runs.values())
    assert SYNTHETIC_NOTE in page  # the invented rows say so in the report
    if shutil.which("chromium"):
        shot = _screenshot_module()
        png = shot.screenshot(out, tmp_path / "r.png", height=2400)
        shot.assert_not_blank(png)


def test_report_last_5_markdown(real, tmp_path):
    store, _, _, _ = real
    out = tmp_path / "r.md"
    result = run("report", "--last", "5", "--out", str(out), "--db", str(store.path))
    assert result.exit_code == 0, result.output
    assert "(5 runs" in result.output and list(tmp_path.glob("r-*.png"))
    text = out.read_text()
    assert all(r.run_id in text for r in real[1].values())  # the 4 real runs are the newest
    assert "## Throughput against batch size" in text and "## Latency distribution" in text
