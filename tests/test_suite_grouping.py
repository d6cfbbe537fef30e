"""`make test` runs two pytest-xdist workers with `--dist loadgroup`: a file's module-scoped server
is built once, and files that share something (the vLLM engines) stay on one worker. pytest 9
moved the node id that pytest-xdist 3.8 appends the group to, and the groups silently fell apart:
each test went to either worker, module servers were built twice, and test_vllm_e2e's clean-up
stopped the engine of the vLLM serve test's server running beside it. This runs the installed pytest
and xdist on a few files and checks that a group stays on one worker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

GROUPED = """
import os, pathlib, pytest
pytestmark = pytest.mark.xdist_group("shared")

@pytest.mark.parametrize("i", range(3))
def test_it(i):
    pathlib.Path(os.environ["WHERE"], f"{__name__}-{i}").write_text(os.environ["PYTEST_XDIST_WORKER"])
"""
OTHER = """
import time

def test_it():
    time.sleep(0.2)
"""


def test_a_group_of_files_runs_on_one_worker(tmp_path: Path):
    (tmp_path / "where").mkdir()
    for name in ("test_first.py", "test_second.py"):
        (tmp_path / name).write_text(GROUPED)
    for i in range(4):
        (tmp_path / f"test_other_{i}.py").write_text(OTHER)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider", "."],
        cwd=tmp_path,
        env={**os.environ, "WHERE": str(tmp_path / "where")},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    workers = {p.name: p.read_text() for p in (tmp_path / "where").iterdir()}
    assert len(workers) == 6, workers
    assert len(set(workers.values())) == 1, f"the group ran on several workers: {workers}"
