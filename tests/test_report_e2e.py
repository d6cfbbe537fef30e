"""End to end on real measurements: MiniLM-L6 benched by the real engine (own child process each).

  main     plan "baseline", threads=2, batch 8     measured
  b1       plan "baseline", threads=2, batch 1     measured: a second batch size for the report's curves
  base     main, its spread set to 2%              derived: the regress baseline
  pr-same  base, copied                            derived: must pass `accelab regress`
  pr-slow  base, threads=1, every latency x 1.5    derived: must fail `accelab regress`

The regress runs are derived from the real run by fixed arithmetic (its spread too, which sets
regress's noise limit), each noted as such, so the verdicts are deterministic: they need no
quiet machine (a real thread-count change on a shared 2-core box sometimes measured no slower).
The store also gets SYNTHETIC Results (tests/test_report_helpers.py, each noted as such) for the
kinds whose engines are not run here (train, loadtest, tune), so that every report section is
drawn. About 40 s on a 2-core CPU.
"""

from __future__ import annotations

import copy

import pytest
import typer
from test_report import ALL_SECTIONS, _screenshot_module, assert_self_contained, png_payloads
from test_report_helpers import SYNTHETIC_NOTE, loadtest, train, tune_group
from typer.testing import CliRunner

from accelab.report import commands
from accelab.report.regress import compare
from accelab.results import contract as K
from accelab.results.result import new_run_id
from accelab.results.store import Store

pytestmark = [pytest.mark.slow, pytest.mark.alone]  # timing: see tests/conftest.py
SLOWDOWN = 1.5
LATENCY_KEYS = ("p50", "p90", "p99", "mean", "min", "max", "stdev")


def run(*args: str):
    app = typer.Typer()
    commands.register(app)
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


def measure(threads: int, batch_size: int, tag: str):
    from accelab.benchmark.engine import bench
    from accelab.catalog.resolve import resolve
    from accelab.plan.plan import Plan
    from accelab.scenarios.workload import Workload

    workload = Workload(
        scenario="forward", batch_size=batch_size, seq_len=128, min_iters=10, min_seconds=2 if batch_size > 1 else 1
    )
    result = bench(resolve("minilm-l6"), Plan(name="baseline", threads=threads), workload, tag=tag, timeout_s=600)
    assert result.ok, f"{result.status}: {result.reason}\n{result.metrics.get('traceback', '')}"
    return result


def derived(real, tag: str, *, slowdown: float = 1.0, threads: int | None = None, spread: float | None = None):
    """A copy of a real run with every latency x `slowdown` (throughput and per-round rates
    / `slowdown`), and with `spread` its cv, tail and four quiet rounds set to that share of the
    median: fixed arithmetic, noted in the Result, so what regress decides does not depend on the
    machine (a real run measured while CI's machine was busy would say "unreliable")."""
    r = copy.deepcopy(real)
    r.run_id, r.tag = new_run_id(), tag
    latency = r.metrics["latency_ms"]
    if spread is not None:
        p50 = latency["p50"]
        latency.update(
            cv=spread,
            stdev=spread * p50,
            mean=p50,
            min=p50 * (1 - spread),
            p90=p50 * (1 + spread),
            p99=p50 * (1 + 2 * spread),
            max=p50 * (1 + 3 * spread),
        )
        rate = r.metrics["throughput"]
        r.metrics[K.ROUNDS] = [
            {
                "rate": rate * (1 + k * spread),
                "seconds": 1.0,
                "calls": 10,
                "cv": spread,
                "used": True,
                "steal": 0.0,
                "others_cores": 0.0,
                "throttled": 0.0,
                "level": "quiet",
            }
            for k in (-1, 0, 1, 0)
        ]
        r.metrics[K.NOISE] = {
            "level": "quiet",
            "reason": "DERIVED: set by the test",
            "steal": 0.0,
            "steal_max": 0.0,
            "others_cores": 0.0,
            "others_cores_max": 0.0,
            "throttled": 0.0,
            "load1": 0.0,
            "cv": spread,
            "rounds": 4,
            "rounds_used": 4,
        }
    for key in LATENCY_KEYS:
        if latency.get(key) is not None:
            latency[key] *= slowdown
    r.metrics["throughput"] /= slowdown
    for turn in r.metrics.get(K.ROUNDS) or []:
        turn["rate"] /= slowdown
    if threads is not None:
        r.plan["threads"] = threads
        r.metrics["threads"]["intra_op"] = threads
    fixed = f", spread {spread:.0%}" if spread is not None else ""
    r.notes.append(
        f"DERIVED test input: run {real.run_id} with its latencies x {slowdown}{fixed} (tests/test_report_e2e.py)"
    )
    return r


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    store = Store(tmp_path_factory.mktemp("e2e") / "results.db")
    main = measure(2, 8, "main")
    base = derived(main, "base", spread=0.02)
    runs = {
        "main": main,
        "base": base,
        "pr-slow": derived(base, "pr-slow", slowdown=SLOWDOWN, threads=1),
        "pr-same": derived(base, "pr-same"),
        "b1": measure(2, 1, "b1"),
    }
    store.add(*runs.values())
    synthetic = [train(), train("bf16", speed=1.6, decay=0.96), loadtest(), *tune_group()]
    for i, r in enumerate(synthetic):  # older than the real runs: `--last N` means the real ones
        r.created = f"2026-01-01T00:00:{i:02d}+00:00"
    store.add(*synthetic)
    return store, runs, synthetic


def test_real_runs_carry_what_the_report_and_regress_read(real):
    _, runs, _ = real
    for r in runs.values():
        assert r.fingerprint and r.environment.get("cpu_model")
        assert r.metrics["latency_ms"]["n"] >= 10 and r.metrics["throughput"] > 0 and r.metrics["peak_memory_mb"] > 0
    assert runs["pr-slow"].metrics["threads"]["intra_op"] == 1 and runs["main"].metrics["threads"]["intra_op"] == 2


def test_regress_passes_a_repeat_of_the_same_plan(real):
    store, runs, _ = real
    result = run("regress", "--baseline", "base", "--candidate", "pr-same", "--db", str(store.path))
    assert result.exit_code == 0, result.output
    assert "no regression" in result.output


def test_regress_fails_the_slowed_plan(real):
    store, runs, _ = real
    result = run("regress", "--baseline", "base", "--candidate", "pr-slow", "--db", str(store.path))
    assert result.exit_code == 1, result.output
    assert "plans differ: threads 2 -> 1" in result.output
    (pair,) = compare([runs["base"]], [runs["pr-slow"]]).pairs
    verdicts = {c.metric: c.verdict for c in pair.checks}
    assert verdicts["p50"] == "REGRESSION" and verdicts["throughput"] == "REGRESSION"
    p50 = next(c for c in pair.checks if c.metric == "p50")
    assert p50.change > p50.limit >= 0.05  # the slowdown exceeds both the threshold and the noise


def test_report_on_real_runs_is_self_contained_with_plots(real, tmp_path):
    store, runs, synthetic = real
    by_kind = {r.kind: r for r in synthetic}
    out = tmp_path / "r.html"
    result = run(
        "report",
        "--last",
        "5",
        "--group",
        "tune01",
        "--run",
        by_kind["train"].run_id,
        "--run",
        by_kind["loadtest"].run_id,
        "--out",
        str(out),
        "--db",
        str(store.path),
    )
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
    assert "DERIVED test input" in page  # and so do the derived ones
    shot = _screenshot_module()  # `make test` installs Chromium where it is missing
    png = shot.screenshot(out, tmp_path / "r.png", height=2400)
    shot.assert_not_blank(png)


def test_report_last_5_markdown(real, tmp_path):
    store, _, _ = real
    out = tmp_path / "r.md"
    result = run("report", "--last", "5", "--out", str(out), "--db", str(store.path))
    assert result.exit_code == 0, result.output
    assert "(5 runs" in result.output and list(tmp_path.glob("r-*.png"))
    text = out.read_text()
    assert all(r.run_id in text for r in real[1].values())  # the 5 runs (2 measured, 3 derived) are the newest
    assert "## Throughput against batch size" in text and "## Latency distribution" in text
