"""The child-process protocol: results, errors with tracebacks, OOM, crashes and timeouts."""

import os
import time

import psutil
import pytest

from accelab.measure.runner import ChildError, ChildJob, run_isolated

# Targets live in tests/child_targets.py so that a spawned child can import them.
T = "child_targets"


@pytest.fixture(autouse=True)
def _importable(monkeypatch):
    here = os.path.dirname(__file__)
    monkeypatch.setenv("PYTHONPATH", here + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.syspath_prepend(here)


def test_ok_returns_value_and_sees_env():
    outcome = run_isolated(ChildJob(target=f"{T}:echo_env", payload="ACCELAB_X", env={"ACCELAB_X": "42"}))
    assert outcome.status == "ok"
    assert outcome.value == {"value": "42", "pid_differs": True}


def test_error_carries_child_traceback():
    outcome = run_isolated(ChildJob(target=f"{T}:fail", payload="bad input"))
    assert outcome.status == "error"
    assert "ValueError: bad input" in outcome.reason
    assert "child_targets.py" in outcome.traceback and "def fail" not in outcome.reason
    with pytest.raises(ChildError, match="bad input"):
        outcome.unwrap()


def test_fake_oom_is_reported_as_oom():
    # Fake: this CPU machine has no GPU to run out of; the child raises torch.OutOfMemoryError.
    outcome = run_isolated(ChildJob(target=f"{T}:fake_cuda_oom"))
    assert outcome.status == "oom"
    assert "OutOfMemoryError" in outcome.reason


def test_hard_crash_is_reported_with_signal():
    outcome = run_isolated(ChildJob(target=f"{T}:kill_self"))
    assert outcome.status == "crashed"
    assert "SIGKILL" in outcome.reason


def test_exit_without_result():
    outcome = run_isolated(ChildJob(target=f"{T}:exit_now", payload=3))
    assert outcome.status == "crashed"
    assert "code 3" in outcome.reason


def test_timeout_kills_child_and_its_children(tmp_path):
    pid_file = tmp_path / "pids"
    t0 = time.perf_counter()
    outcome = run_isolated(ChildJob(target=f"{T}:hang_with_grandchild", payload=str(pid_file), timeout_s=8))
    assert outcome.status == "timeout"
    assert time.perf_counter() - t0 < 30
    assert "raise the timeout" in outcome.reason
    # neither the child nor the process it started is left behind (a SIGKILL lands a moment later on
    # a busy machine: wait for it, at most 10 s)
    for pid in map(int, pid_file.read_text().split()):
        deadline = time.monotonic() + 10
        while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, f"process {pid} is still {psutil.Process(pid).status()}"
            time.sleep(0.05)


def test_parent_does_not_spin_while_waiting():
    proc = psutil.Process()
    before = proc.cpu_times()
    outcome = run_isolated(ChildJob(target=f"{T}:sleep", payload=2.0))
    after = proc.cpu_times()
    assert outcome.ok
    # a spinning parent would burn ~2 s of CPU; blocking costs little beyond spawning
    assert (after.user - before.user) + (after.system - before.system) < 0.8
