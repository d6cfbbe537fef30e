"""The one launcher of train and predict workers (`accelab.launch`): the command line, and the
kill policy on real processes: a stopped or finished launch leaves nothing of its process group
running, a failing worker gives the failed Outcome, the launched process dies with its parent.
A few seconds in all."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from accelab import launch
from accelab.launch import ELSEWHERE, LaunchOptions, run_workers, worker_command

TRAIN, PREDICT = "accelab.train.worker", "accelab.predict.worker"
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

# A stand-in worker: records its pid (and its child's), then sleeps or writes a summary and exits.
# Its child ignores SIGTERM, as a stuck grandchild would: only the group's SIGKILL ends it.
WORKER = """
import json, os, signal, subprocess, sys, time
spec = json.loads(sys.argv[1])
if spec.get("ignore_term"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
pids = [os.getpid()]
if spec.get("child", True):
    ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    pids.append(subprocess.Popen([sys.executable, "-c", ignore]).pid)
if spec.get("doc") is not None:
    open(spec["summary"], "w").write(json.dumps(spec["doc"]))
open(spec["pids"] + ".tmp", "w").write(json.dumps(pids))
os.replace(spec["pids"] + ".tmp", spec["pids"])
if "exit" in spec:
    sys.exit(spec["exit"])
time.sleep(600)
"""


# the command line ----------------------------------------------------------------------------
def test_one_process_runs_the_worker_module_directly():
    assert worker_command(TRAIN, Path("/c.json"), LaunchOptions()) == [sys.executable, "-m", TRAIN, "/c.json"]


def test_torchrun_command_single_node_is_standalone():
    for module in (TRAIN, PREDICT):
        cmd = worker_command(module, Path("/c.json"), LaunchOptions(nproc=2))
        assert cmd[:6] == [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone"]
        assert cmd[-3:] == ["-m", module, "/c.json"]


def test_torchrun_command_passes_multi_node_options_through():
    options = LaunchOptions(nproc=8, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29500)
    cmd = worker_command(TRAIN, Path("/c.json"), options)
    assert "--standalone" not in cmd
    assert "--nnodes 2 --node_rank 1 --master_addr 10.0.0.1 --master_port 29500" in " ".join(cmd)
    rdzv = LaunchOptions(nproc=4, nnodes=2, rdzv_backend="c10d", rdzv_endpoint="h:29400", rdzv_id="job7")
    assert "--rdzv_backend c10d --rdzv_endpoint h:29400 --rdzv_id job7" in " ".join(
        worker_command(PREDICT, Path("/c"), rdzv)
    )
    assert options.world_size == 16


def test_launch_options_reject_inconsistent_values():
    with pytest.raises(ValueError, match="--master-addr"):
        LaunchOptions(nproc=2, nnodes=2)
    with pytest.raises(ValueError, match="--node-rank 2"):
        LaunchOptions(nnodes=2, node_rank=2, master_addr="h")


# the kill policy, on real processes ----------------------------------------------------------
@pytest.fixture
def worker(tmp_path):
    """(command for a spec, the pids it recorded); whatever a failed test left running is killed."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    pids_path, summary = tmp_path / "pids.json", tmp_path / "summary.json"

    def command(**spec) -> list[str]:
        return [sys.executable, str(script), json.dumps({"pids": str(pids_path), "summary": str(summary), **spec})]

    def pids(timeout_s: float = 30) -> list[int]:
        deadline = time.monotonic() + timeout_s
        while not pids_path.exists():
            assert time.monotonic() < deadline, "the worker never started"
            time.sleep(0.02)
        return json.loads(pids_path.read_text())

    yield command, pids, summary
    if pids_path.exists():
        for pid in json.loads(pids_path.read_text()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def alive(pids: list[int], within_s: float = 5.0) -> list[int]:
    """Those of `pids` still running after `within_s` (a zombie nobody reaped yet counts as gone)."""
    deadline = time.monotonic() + within_s
    while True:
        running = [pid for pid in pids if _running(pid)]
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.02)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_worker_past_its_timeout_is_stopped_with_its_whole_process_group(worker):
    command, pids, summary = worker
    start = time.monotonic()
    outcome = run_workers(
        command(), summary_path=summary, threads=None, timeout_s=2, what="predict", kept="the finished chunks are kept"
    )
    assert alive(pids()) == []
    assert (outcome.status, outcome.returncode, outcome.summary) == ("timeout", None, None)
    assert outcome.reason == "predict did not finish within 2 s; raise --timeout (the finished chunks are kept)"
    assert 2 <= outcome.wall_s < 5 and time.monotonic() - start < 10  # the SIGTERM-ignoring child cost no grace


def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace(worker, monkeypatch):
    command, pids, summary = worker
    monkeypatch.setattr(launch, "STOP_GRACE_S", 0.5)
    start = time.monotonic()
    outcome = run_workers(command(ignore_term=True), summary_path=summary, threads=None, timeout_s=2, what="training")
    assert alive(pids()) == []
    assert outcome.status == "timeout" and outcome.reason == "training did not finish within 2 s; raise --timeout"
    assert time.monotonic() - start < 6


def test_a_worker_that_exits_non_zero_without_a_result_is_crashed_and_leaves_nothing(worker):
    command, pids, summary = worker
    outcome = run_workers(command(exit=3), summary_path=summary, threads=None, timeout_s=60, what="training")
    assert alive(pids()) == []  # its SIGTERM-ignoring child went with the group
    assert (outcome.status, outcome.returncode, outcome.summary) == ("crashed", 3, None)
    assert outcome.reason == "worker exited with code 3 without a result; see its output above"


def test_a_worker_killed_by_a_signal_is_crashed(worker):
    command, pids, summary = worker
    outcome = run_workers(
        [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"],
        summary_path=summary,
        threads=None,
        timeout_s=60,
        what="training",
        kept="rerun it",
    )
    assert (outcome.status, outcome.returncode) == ("crashed", -signal.SIGSEGV)
    assert (
        outcome.reason == f"worker killed by signal {int(signal.SIGSEGV)} without a result; see its output above "
        "(rerun it)"
    )


@pytest.mark.parametrize(
    "code, doc, expected",
    [
        (0, {"status": "ok", "loss": 1.5}, ("ok", None)),
        (0, None, ("ok", ELSEWHERE)),  # a node without global rank 0
        (2, {"status": "error", "reason": "--batch-size 7 is odd"}, ("error", "--batch-size 7 is odd")),
        (3, {"status": "unsupported", "reason": "no bf16 here"}, ("unsupported", "no bf16 here")),
    ],
)
def test_the_outcome_is_what_rank_0_reported(worker, code, doc, expected):
    command, pids, summary = worker
    outcome = run_workers(
        command(exit=code, doc=doc, child=False), summary_path=summary, threads=None, timeout_s=60, what="training"
    )
    assert (outcome.status, outcome.reason) == expected
    assert outcome.summary == (doc if expected[0] == "ok" else None)
    assert outcome.returncode == code and outcome.command == command(exit=code, doc=doc, child=False)


def test_the_workers_get_the_run_s_threads(worker):
    _, _, summary = worker
    script = (
        f"import json, os; open({str(summary)!r}, 'w').write(json.dumps({{'status': 'ok', "
        "'threads': os.environ['OMP_NUM_THREADS']}))"
    )
    outcome = run_workers([sys.executable, "-c", script], summary_path=summary, threads=3, timeout_s=60, what="x")
    assert outcome.summary == {"status": "ok", "threads": "3"}


# a parent that cannot clean up ---------------------------------------------------------------
def _launching_parent(worker_command: list[str], summary: Path) -> subprocess.Popen:
    # Python leaves SIGINT ignored when it starts with it ignored (a job started with & by a
    # non-interactive shell, as CI scripts do): the parent acts as a terminal's Python does
    script = (
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "import sys; from pathlib import Path; from accelab.launch import run_workers; "
        f"run_workers({worker_command!r}, summary_path=Path({str(summary)!r}), threads=None, timeout_s=600, "
        "what='training')"
    )
    return subprocess.Popen([sys.executable, "-c", script])


@linux_only
def test_the_launched_process_dies_with_a_parent_killed_outright(worker):
    command, pids, summary = worker
    parent = _launching_parent(command(child=False), summary)
    try:
        (leader,) = pids()
        parent.kill()  # SIGKILL: no finally runs in the parent
        parent.wait()
        assert alive([leader]) == []
    finally:
        parent.kill()


def test_ctrl_c_in_the_parent_stops_the_whole_group(worker):
    command, pids, summary = worker
    parent = _launching_parent(command(), summary)
    try:
        launched = pids()
        parent.send_signal(signal.SIGINT)  # a terminal's Ctrl-C reaches the parent only: the workers have a session
        assert parent.wait(timeout=30) != 0  # KeyboardInterrupt, after the stop
        assert alive(launched) == []
    finally:
        parent.kill()


@linux_only
def test_a_torchrun_rank_dies_with_its_agent(tmp_path):
    pid_path = tmp_path / "rank.pid"
    rank = (
        "import os, time; from accelab.launch import start_worker; start_worker(); "
        f"open({str(pid_path)!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    )
    agent = (
        "import os, subprocess, sys, time; "  # the rank in a session of its own, as torchrun starts it
        f"subprocess.Popen([sys.executable, '-c', {rank!r}], env={{**os.environ, 'WORLD_SIZE': '2'}}, "
        "start_new_session=True); time.sleep(600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", agent])
    try:
        deadline = time.monotonic() + 30
        while not pid_path.exists() or not pid_path.read_text():
            assert time.monotonic() < deadline, "the rank never started"
            time.sleep(0.02)
        proc.kill()
        proc.wait()
        assert alive([int(pid_path.read_text())]) == []
    finally:
        proc.kill()
        if pid_path.exists() and pid_path.read_text() and _running(int(pid_path.read_text())):
            os.kill(int(pid_path.read_text()), signal.SIGKILL)
