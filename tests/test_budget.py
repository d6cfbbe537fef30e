"""How long a plan may run before it is stopped as too slow (pure), and a compare row stopped
for real."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from accelab.measure.budget import PlanBudget


def test_only_plans_expected_slow_get_a_budget_scaled_on_the_reference():
    budget = PlanBudget(slow={"int8-dynamic": "measured 0.04x fp32 eager on a transformer MLP here"})
    assert budget.seconds_for(["compile"], reference_s=30.0) is None
    assert budget.seconds_for(["int8-dynamic"], reference_s=None) is None  # no yardstick yet
    assert budget.seconds_for(["int8-dynamic"], reference_s=30.0) == 90.0
    assert budget.seconds_for(["int8-dynamic"], reference_s=5.0) == 60.0  # at least a minute
    reason = budget.stopped_reason(90.0, 91.4, ["int8-dynamic"])
    assert reason == (
        "stopped: too slow, ran 91 s of its 90 s budget (expected: int8-dynamic: measured 0.04x fp32 "
        "eager on a transformer MLP here)"
    )


def test_an_explicit_budget_applies_to_every_plan_and_must_be_positive():
    assert PlanBudget(explicit_s=20.0).seconds_for([], reference_s=None) == 20.0
    assert (
        PlanBudget(explicit_s=20.0).stopped_reason(20.0, 20.2, []) == "stopped: too slow, ran 20 s of its 20 s budget"
    )
    with pytest.raises(ValueError, match="--max-seconds-per-plan 0"):
        PlanBudget(explicit_s=0)


def test_the_start_line_announces_a_budget_as_a_limit():
    slow = PlanBudget(slow={"bf16-autocast": "measured 0.40x fp32 here"})
    assert slow.announcement(["compile"]) is None
    assert slow.announcement(["bf16-autocast"], "the first row's") == (
        "expected slow here (bf16-autocast: measured 0.40x fp32 here); budget 3x the first row's time "
        "(at least 60 s), then stopped"
    )
    assert PlanBudget(explicit_s=45.0).announcement([]) == "budget 45 s, then stopped"


@pytest.mark.slow
@pytest.mark.alone  # a time budget: beside another worker the noise guard measures again and the baseline runs past it
def test_compare_stops_a_plan_past_its_budget_and_says_so(tmp_path):
    """ViT-base at batch 64 takes seconds per call here, batch 1 a fraction: with a 25 s budget
    the big batch is stopped, its row says why, and compare still succeeds (an answer, not a failure)."""
    out = tmp_path / "c.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelab",
            "compare",
            "vit-base",
            "--plans",
            "baseline,baseline[batch_size=64]",
            "--no-quality",
            "--warmup",
            "1",
            "--min-iters",
            "5",
            "--min-seconds",
            "2",
            "--max-seconds-per-plan",
            "25",
            "--json",
            str(out),
            "--no-store",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["plan"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["baseline"]["status"] == "ok"
    slow = rows["baseline[batch_size=64]"]
    assert slow["status"] == "stopped" and re.search(
        r"stopped: too slow, ran 2[5-9] s of its 25 s budget", slow["notes"]
    )
