"""The one batch-size rule, `resolve_batch_size`: an explicit --batch-size, else the plan's
batch_size, else the command's default. Alone, then through the real option parsing of
`accelab bench` and `compare`, with the measuring child replaced by a recorder (no model is
loaded: the model directory holds only a config.json)."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from accelab.benchmark import commands as bench_commands
from accelab.plan.plan import Plan
from accelab.results.result import Result
from accelab.scenarios.workload import resolve_batch_size


def test_the_flag_wins_then_the_plan_then_the_default():
    assert resolve_batch_size(4, Plan(batch_size=16), 1) == 4
    assert resolve_batch_size(None, Plan(batch_size=16), 1) == 16
    assert resolve_batch_size(None, Plan(), 8) == 8
    assert resolve_batch_size(None, None, 8) == 8
    assert resolve_batch_size(2, None, 8) == 2


@pytest.fixture
def model_dir(tmp_path):
    directory = tmp_path / "tiny-bert"
    directory.mkdir()
    (directory / "config.json").write_text(
        json.dumps({"model_type": "bert", "architectures": ["BertModel"], "max_position_embeddings": 128})
    )
    return str(directory)


@pytest.fixture
def seen(monkeypatch):
    """(plan name, batch size) of every run the commands start, in order; each run is answered
    'unsupported', so nothing is measured."""
    runs: list[tuple[str, int]] = []

    def fake_bench(spec, plan, workload, **kwargs):
        runs.append((plan.name, workload.batch_size))
        return Result(
            kind=kwargs.get("kind", "bench"),
            status="unsupported",
            reason="recorded by the test",
            model=spec.to_dict(),
            plan=plan.to_dict(),
            workload=workload.to_dict(),
        )

    def fake_measure_plans(spec, plans, workloads, **kwargs):
        return [fake_bench(spec, plan, workload, **kwargs) for plan, workload in zip(plans, workloads)]

    monkeypatch.setattr("accelab.benchmark.engine.bench", fake_bench)
    monkeypatch.setattr("accelab.benchmark.compare.measure_plans", fake_measure_plans)
    monkeypatch.setattr("accelab.measure.capabilities.slow_techniques", lambda device, measure=False: {})
    return runs


def run(*args: str):
    app = typer.Typer()
    bench_commands.register(app)
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


def bench(model_dir: str, *args: str):
    return run("bench", model_dir, "--task", "feature-extraction", "--no-store", "--device", "cpu", *args)


def test_bench_takes_the_flag_over_the_plan_and_the_plan_over_the_default(model_dir, seen):
    for args in (["--set", "batch_size=16", "--batch-size", "4"], ["--set", "batch_size=16"], []):
        result = bench(model_dir, *args)
        assert result.exit_code == 0, result.output
    assert [batch for _, batch in seen] == [4, 16, 1]


def test_bench_reads_the_batch_size_of_a_plan_file(model_dir, seen, tmp_path):
    plan_file = tmp_path / "tuned.yaml"
    plan_file.write_text(Plan(name="tuned", batch_size=32).to_yaml())
    assert bench(model_dir, "--plan", str(plan_file)).exit_code == 0
    assert bench(model_dir, "--plan", str(plan_file), "-b", "2").exit_code == 0
    assert seen == [("tuned", 32), ("tuned", 2)]


def test_compare_lets_each_plans_own_batch_size_win_over_the_shared_one(model_dir, seen):
    result = run(
        "compare",
        model_dir,
        "--task",
        "feature-extraction",
        "--no-store",
        "--no-quality",
        "--device",
        "cpu",
        "--plans",
        "baseline,baseline[batch_size=16]",
        "--batch-size",
        "8",
    )
    assert result.exit_code == 0, result.output
    assert seen == [("baseline", 8), ("baseline[batch_size=16]", 16)]


def test_compare_default_batch_is_one_and_set_changes_every_plan(model_dir, seen):
    args = [
        "compare",
        model_dir,
        "--task",
        "feature-extraction",
        "--no-store",
        "--no-quality",
        "--device",
        "cpu",
        "--plans",
        "baseline,baseline[batch_size=16]",
    ]
    assert run(*args).exit_code == 0
    assert run(*args, "--set", "batch_size=4").exit_code == 0
    # --set applies before a plan's inline fields: the inline batch_size=16 still wins
    assert seen == [
        ("baseline", 1),
        ("baseline[batch_size=16]", 16),
        ("baseline+batch_size=4", 4),
        ("baseline[batch_size=16]", 16),
    ]


def test_a_batch_size_below_one_names_the_flag(model_dir, seen):
    result = bench(model_dir, "--batch-size", "0")
    assert isinstance(result.exception, ValueError)
    assert "--batch-size 1 or more" in str(result.exception)
    assert seen == []
