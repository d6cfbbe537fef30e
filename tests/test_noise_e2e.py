"""Never a confident wrong row: `accelab compare` of two plans whose true order is known here,
measured while a real busy loop on one core switches on and off (tests/busy.py).

MiniLM with torch's 2 threads against the same model on 1 thread: on a quiet 2-core machine 2
threads are faster; while another process holds a core, 2 threads collapse (their OpenMP team
waits for the busy core) and measured one after another the 1-thread plan can come out ahead.
Every row must be right about the order, with its verdict, or say "unreliable" or "no
measurable difference". The rounds record must show that the load was seen and left out.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from busy import switching_load

ALLOWED_UNDECIDED = {"unreliable", "no measurable difference"}


@pytest.mark.slow
@pytest.mark.alone  # its load is the busy loop alone, not a second test worker too
def test_compare_under_a_switching_load_is_right_or_says_it_cannot_tell(tmp_path):
    out = tmp_path / "compare.json"
    with switching_load(on_s=3.0, off_s=4.0, core=1):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "accelab",
                "compare",
                "minilm-l6",
                "--plans",
                "baseline,baseline[threads=1]",
                "--batch-size",
                "8",
                "--seq-len",
                "64",
                "--no-quality",
                "--warmup",
                "1",
                "--min-seconds",
                "2",
                "--json",
                str(out),
                "--no-store",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = {r["plan"]: r for r in doc["rows"]}
    one_thread = rows["baseline[threads=1]"]
    assert rows["baseline"]["status"] == one_thread["status"] == "ok"
    verdict = one_thread["speedup_verdict"]
    assert verdict in {"slower"} | ALLOWED_UNDECIDED, one_thread  # "faster" would be a confident wrong row
    if verdict == "slower":
        assert one_thread["speedup_high"] < 1.0 and one_thread["speedup"] < 1.0
    else:
        assert verdict in one_thread["notes"]  # the table says it could not tell, and why
    # the load was seen: some rounds were measured beside it and left out of the figures
    results = {r["plan"]["name"]: r for r in doc["results"]}
    rounds = results["baseline"]["metrics"]["rounds"] + results["baseline[threads=1]"]["metrics"]["rounds"]
    assert any(r["level"] == "unreliable" and not r["used"] for r in rounds), rounds
    for plan, row in rows.items():  # every quiet round is used; a loud one only to reach --min-iters,
        mine = results[plan]["metrics"]["rounds"]  # when the extra rounds ran out, and the row says so
        assert all(r["used"] for r in mine if r["level"] != "unreliable"), (plan, mine)
        if any(r["used"] and r["level"] == "unreliable" for r in mine):
            assert row["noise"] == "unreliable", (plan, row)
    noises = [results[name]["metrics"]["noise"] for name in ("baseline", "baseline[threads=1]")]
    for name, noise in zip(("baseline", "baseline[threads=1]"), noises):
        assert noise["rounds"] == len(results[name]["metrics"]["rounds"])
    # the loop's core showed in at least one window of the run (one plan's rounds may all have fallen
    # in the loop's off phases: seen once in CI, 0.09 cores at most for one plan)
    assert max(noise["others_cores_max"] for noise in noises) >= 0.3
    assert "round 1/6" in proc.stderr  # the rounds alternate and say so
