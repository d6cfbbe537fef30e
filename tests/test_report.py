"""Report building (pure series and document), the HTML / markdown files, REFs and the regress
command. Results are SYNTHETIC (tests/test_report_helpers.py); tests/test_report_e2e.py runs the
same on real bench Results."""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import re
from pathlib import Path

import pytest
import typer
from PIL import Image
from test_report_helpers import OTHER_ENV, OTHER_FINGERPRINT, SYNTHETIC_NOTE, bench, loadtest, train, tune_group
from typer.testing import CliRunner

from accelab.report import commands, series as S
from accelab.report.build import build_document
from accelab.report.document import Figure
from accelab.report.plots import draw
from accelab.report.refs import load_ref
from accelab.report.render import to_html, write_report
from accelab.results.store import Store

DATA_URI = re.compile(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"')
ALL_SECTIONS = [
    "summary",
    "speedup",
    "latency",
    "throughput-batch",
    "memory-batch",
    "pareto",
    "loadtest",
    "training",
    "environment",
    "runs",
]


def run(*args: str):
    app = typer.Typer()
    commands.register(app)
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


def every_kind() -> list:
    return [
        bench(batch=1, p50=3.0, memory=300, created="2026-11-01T10:00:01+00:00"),
        bench(batch=8, p50=10.0, with_samples=True, created="2026-11-01T10:00:02+00:00"),
        bench(batch=1, plan="compile", p50=2.5, quality="warn", memory=450, created="2026-11-01T10:00:03+00:00"),
        bench(batch=8, plan="compile", p50=7.0, quality="pass", created="2026-11-01T10:00:04+00:00"),
        train(),
        train("bf16", speed=1.6, decay=0.96),
        loadtest(),
        *tune_group(),
    ]


def png_payloads(page: str) -> list[bytes]:
    return [base64.b64decode(m) for m in DATA_URI.findall(page)]


def assert_self_contained(page: str) -> None:
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I), "external reference"
    assert "<script" not in page.lower() and "@import" not in page and "url(" not in page
    assert "<link" not in page.lower()


# -- series (pure) -----------------------------------------------------------------------------
def test_pareto_front_keeps_only_undominated_points():
    costs, gains = [4, 9, 15, 20, 22, 33, 30], [250, 500, 571, 889, 400, 1067, 267]
    assert S.pareto_front(costs, gains) == [0, 1, 2, 3, 5]
    assert S.pareto_front([1, 1, 2], [5, 7, 6]) == [1]  # equal cost: the higher gain only
    assert S.pareto_front([], []) == []


def test_cdf_from_samples_and_from_percentiles():
    xs, ys = S.cdf_points([3.0, 1.0, 2.0, 4.0])
    assert xs == [1.0, 2.0, 3.0, 4.0] and ys == [0.25, 0.5, 0.75, 1.0]
    xs, ys = S.percentile_points({"min": 1, "p50": 2, "p90": 3, "p99": 4, "max": 5})
    assert xs == [1, 2, 3, 4, 5] and ys == [0.0, 0.5, 0.9, 0.99, 1.0]


def test_latency_panels_use_raw_samples_when_stored():
    panels = S.latency_panels([bench(batch=8, with_samples=True, n=40), bench(batch=8, plan="compile")])
    assert len(panels) == 1
    raw, summary = panels[0].curves
    assert raw.from_samples and len(raw.xs) == 40 and not summary.from_samples and len(summary.xs) == 5


def test_plan_labels_tell_apart_plans_that_share_a_name():
    fast, slow = bench(), bench()
    slow.plan = {**slow.plan, "threads": 1}
    labels = S.plan_labels([fast, slow])
    assert labels[fast.run_id] == "baseline (threads=2)" and labels[slow.run_id] == "baseline (threads=1)"


def test_batch_panels_need_two_batch_sizes():
    assert S.batch_panels([bench(batch=8), bench(batch=8, plan="compile")], "throughput") == []
    panels = S.batch_panels(
        [bench(batch=1, p50=3), bench(batch=8, p50=10), bench(batch=8, plan="compile", p50=7)], "throughput"
    )
    lines = {line.label: line.points for line in panels[0].lines}
    assert lines["baseline"] == [(1, pytest.approx(333.33, rel=1e-3)), (8, pytest.approx(800.0))]
    assert lines["compile"] == [(8, pytest.approx(8 / 0.007))]


def test_pareto_sets_from_a_tune_group():
    (ps,) = S.pareto_sets(tune_group())
    front = [ps.points[i].label for i in ps.front_latency]
    assert front == ["baseline@1", "compile@4", "bf16@8", "int8-dynamic@16", "int8-dynamic@32"]
    assert "slow@8" not in [ps.points[i].label for i in ps.front_memory]
    baseline8 = next(p for p in ps.points if p.label == "baseline@8")
    assert baseline8.p99_ms == pytest.approx(22.0) and len(ps.points) == 7  # the final run, not the screening one
    assert S.pareto_sets([bench(group_id="g"), bench(plan="x", group_id="g")]) == []  # 2 plans: no chart


def test_a_compare_group_of_three_plans_gets_a_pareto_chart_too():
    group = [
        bench(kind="compare", plan=name, p50=p50, memory=mem, group_id="cmp1")
        for name, p50, mem in (("baseline", 10.0, 500), ("compile", 7.0, 520), ("int8-dynamic", 6.0, 300))
    ]
    (ps,) = S.pareto_sets(group)
    assert [p.label for p in ps.points] == ["baseline", "compile", "int8-dynamic"]
    assert [ps.points[i].label for i in ps.front_latency] == ["int8-dynamic"]
    assert "compare group cmp1" in ps.title


def test_load_curves_from_find_max_probes():
    (curve,) = S.load_curves([loadtest()])
    assert curve.load_name == "rate" and curve.latency_name == "e2e_ms"
    assert [p.load for p in curve.points] == [1, 2, 4, 8, 10, 12, 16]  # search order -> by load
    assert curve.slo_ms == pytest.approx(120.0) and curve.max_load == 10.0
    assert curve.points[-1].p99 > curve.points[0].p99 and curve.points[-1].served == 11.0
    assert curve.points[-1].goodput < curve.points[-1].served


def test_train_curves_from_losses_and_evals_and_none_without_them():
    """(Single load-test runs, closed loops and train runs built by the producers themselves:
    tests/test_results_contract.py.)"""
    a, d = train(), train("empty")
    d.metrics = {"epoch_s": 3.0}
    curves = {cv.label.split(" · ")[1]: cv for cv in S.train_curves([a, d])}
    assert set(curves) == {"baseline"}
    assert len(curves["baseline"].losses) == 60 and curves["baseline"].eval_x == [20.0, 40.0, 60.0]
    assert curves["baseline"].steps[:3] == [1.0, 2.0, 3.0] and curves["baseline"].eval_x_name == "optimizer step"
    assert curves["baseline"].eval_accuracy[-1] == pytest.approx(a.metrics["final_accuracy"])
    assert S.final_accuracy(a) == a.metrics["final_accuracy"] and S.final_accuracy(d) is None


def test_train_runs_read_like_the_train_engine_stores_them():
    r = train(speed=2.0)
    from accelab.report import metrics as M

    assert M.throughput(r) == 200.0 and M.throughput_unit(r) == "samples/s"
    assert M.peak_memory_mb(r) == 900.0 and M.epoch_seconds(r) == 6.0 and M.batch_size(r) == 32
    assert M.workload_label(r) == "train-step · global batch 32"


# -- the document --------------------------------------------------------------------------------
def test_document_has_every_section_when_every_kind_is_present():
    doc = build_document(every_kind())
    assert [s.id for s in doc.sections] == ALL_SECTIONS and doc.skipped == []
    assert {f.chart for f in doc.figures()} == {"latency_cdf", "batch_curve", "pareto", "load_curve", "train_curves"}


def test_sections_without_data_are_left_out_and_listed():
    doc = build_document([bench(batch=8)])
    assert [s.id for s in doc.sections] == ["summary", "speedup", "latency", "environment", "runs"]
    assert any(s.startswith("Training curves") for s in doc.skipped)
    assert any(s.startswith("Tuning trade-off") for s in doc.skipped)
    assert "Not in this report" in doc.sections[0].blocks[-1].text


def test_failed_runs_appear_in_tables_without_breaking_plots():
    failed = bench(plan="int8", status="unsupported", reason="int8 needs fbgemm", metrics={})
    doc = build_document([bench(), failed])
    speedup = next(s for s in doc.sections if s.id == "speedup").blocks[0]
    row = next(r for r in speedup.rows if r[0].text.startswith("int8"))
    assert "unsupported: int8 needs fbgemm" in row[8].text
    assert len(doc.figures()) == 1  # the latency CDF of the run that ran


def test_speedup_is_against_the_plan_named_baseline():
    doc = build_document([bench(plan="compile", p50=5, created="2026-01-01T00:00:00+00:00"), bench(p50=10)])
    table = next(s for s in doc.sections if s.id == "speedup").blocks[0]
    cells = {r[0].text: r[5].text for r in table.rows}
    assert cells == {"baseline (reference)": "1.00x", "compile": "2.00x"}


# -- files -----------------------------------------------------------------------------------------
def test_html_is_one_self_contained_file_with_valid_pngs(tmp_path):
    doc = build_document(every_kind())
    out = tmp_path / "r.html"
    assert write_report(doc, out, draw) == [out]
    page = out.read_text()
    assert_self_contained(page)
    pngs = png_payloads(page)
    assert len(pngs) == len(doc.figures()) >= 7
    for data in pngs:
        with Image.open(io.BytesIO(data)) as img:
            img.verify()
            assert img.format == "PNG"
    for section in ALL_SECTIONS:
        assert f'<section id="{section}">' in page
    assert SYNTHETIC_NOTE in page  # synthetic rows say so in the report itself


def test_html_escapes_text():
    r = bench(plan="<script>alert(1)</script>")
    page = to_html(build_document([r]), lambda f: b"")
    assert "<script>" not in page and "&lt;script&gt;" in page


def test_markdown_writes_pngs_beside_it(tmp_path):
    doc = build_document(every_kind())
    out = tmp_path / "sub" / "report.md"
    written = write_report(doc, out, draw)
    assert written[0] == out and len(written) == 1 + len(doc.figures())
    text = out.read_text()
    for png in written[1:]:
        assert png.parent == out.parent and f"]({png.name})" in text
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "## Latency distribution" in text and "| plan |" in text


def test_unknown_extension_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"use \.html .* or \.md"):
        write_report(build_document([bench()]), tmp_path / "r.pdf", draw)


def test_each_chart_draws_a_png():
    doc = build_document(every_kind())
    seen = set()
    for figure in doc.figures():
        if figure.chart in seen:
            continue
        seen.add(figure.chart)
        with Image.open(io.BytesIO(draw(figure))) as img:
            assert img.size[0] > 600 and img.size[1] > 300
            assert len(img.convert("RGB").getcolors(1 << 20)) > 50  # drawn, not blank


def test_draw_rejects_an_unknown_chart():
    with pytest.raises(KeyError):
        draw(Figure(name="x", chart="pie", data=None, caption="", alt=""))  # type: ignore[arg-type]  # on purpose


# -- REFs and commands ------------------------------------------------------------------------------
@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "r.db")
    s.add(bench(p50=10.0, tag="main"), bench(p50=10.2, tag="pr-same"), bench(p50=19.0, tag="pr-slow"), *every_kind())
    return s


def test_load_ref_by_tag_run_id_and_json(store, tmp_path):
    main = store.query(tag="main")
    assert load_ref("main", store) == main
    assert load_ref(main[0].run_id[:8], store)[0].run_id == main[0].run_id
    single = tmp_path / "one.json"
    single.write_text(main[0].to_json())
    assert load_ref(str(single), store)[0].run_id == main[0].run_id
    group = tmp_path / "compare.json"
    group.write_text(json.dumps({"rows": [], "results": [r.to_dict() for r in tune_group()]}))
    assert len(load_ref(str(group), store)) == 8
    with pytest.raises(ValueError, match="neither a JSON file, a tag nor a run id"):
        load_ref("nothing-like-this", store)
    with pytest.raises(ValueError, match="no file"):
        load_ref(str(tmp_path / "missing.json"), store)


def test_regress_command_passes_repeats_and_fails_a_slowdown(store, tmp_path):
    same = run("regress", "--baseline", "main", "--candidate", "pr-same", "--db", str(store.path))
    assert same.exit_code == 0, same.output
    assert "no regression" in same.output and "metric" in same.output and "limit" in same.output
    out = tmp_path / "regress.json"
    slow = run("regress", "--baseline", "main", "--candidate", "pr-slow", "--db", str(store.path), "--json", str(out))
    assert slow.exit_code == 1, slow.output
    assert "REGRESSION" in slow.output and "+90.0%" in slow.output
    assert json.loads(out.read_text())["regressed"] is True
    loose = run(
        "regress", "--baseline", "main", "--candidate", "pr-slow", "--threshold", "95%", "--db", str(store.path)
    )
    assert loose.exit_code == 0, loose.output


def test_regress_command_refuses_different_machines(store):
    store.add(bench(tag="other-box", environment=OTHER_ENV, fingerprint=OTHER_FINGERPRINT))
    refused = run("regress", "--baseline", "main", "--candidate", "other-box", "--db", str(store.path))
    assert refused.exit_code != 0
    assert "results from different machines are not compared as equals" in str(refused.exception)
    allowed = run(
        "regress",
        "--baseline",
        "main",
        "--candidate",
        "other-box",
        "--allow-different-machines",
        "--db",
        str(store.path),
    )
    assert allowed.exit_code == 0 and "different machines" in allowed.output


def test_regress_command_with_json_refs(store, tmp_path):
    base, cand = tmp_path / "base.json", tmp_path / "cand.json"
    base.write_text(store.query(tag="main")[0].to_json())
    cand.write_text(json.dumps({"results": [store.query(tag="pr-slow")[0].to_dict()]}))
    result = run("regress", "--baseline", str(base), "--candidate", str(cand), "--db", str(store.path))
    assert result.exit_code == 1 and "REGRESSION" in result.output


def test_report_command_selects_runs_and_writes_html(store, tmp_path):
    out = tmp_path / "r.html"
    result = run(
        "report",
        "--last",
        "3",
        "--group",
        "tune01",
        "--compare",
        "main",
        "pr-slow",
        "--out",
        str(out),
        "--db",
        str(store.path),
    )
    assert result.exit_code == 0, result.output
    page = out.read_text()
    assert_self_contained(page)
    assert '<section id="regress">' in page and '<section id="pareto">' in page and "REGRESSION" in page
    assert f"wrote {out}" in result.output and len(png_payloads(page)) >= 2


def test_report_command_defaults_to_the_newest_runs_and_writes_markdown(store, tmp_path):
    out = tmp_path / "r.md"
    result = run("report", "--out", str(out), "--db", str(store.path))
    assert result.exit_code == 0, result.output
    assert "PNGs beside it" in result.output and list(tmp_path.glob("r-*.png"))


def test_report_screenshot_is_not_blank(tmp_path):
    """Headless Chromium, no network: the synthetic every-kind report renders with its plots.
    `make test` installs Chromium where it is missing (Debian's package); it never skips."""
    shot = _screenshot_module()
    html = tmp_path / "r.html"
    write_report(build_document(every_kind()), html, draw)
    png = shot.screenshot(html, tmp_path / "r.png", height=2400)
    distinct, share = shot.assert_not_blank(png)
    assert distinct > shot.MIN_COLOURS and share < shot.MAX_SHARE_OF_ONE_COLOUR


def _screenshot_module():
    path = Path(__file__).parents[1] / "benchmarks" / "report_screenshot.py"
    spec = importlib.util.spec_from_file_location("report_screenshot", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
