"""The server as a real subprocess (a FAKE slow model, same runner as `accelab serve`):
readiness while loading, SIGTERM under load finishes in-flight requests and exits cleanly
within the grace period, leaving no process behind."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil
import pytest
from serving import ServerProcess

FAKE_SERVER = str(Path(__file__).with_name("fake_server.py"))  # run by path, as a script


def chat(url: str, content: str, max_tokens: int, results: list, stream: bool = False) -> None:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "stream": stream}
    try:
        if stream:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            text = "".join(
                json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1] if json.loads(e)["choices"]
            )
            results.append((r.status_code, text, events[-1]))
        else:
            r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
            results.append((r.status_code, r.json()["choices"][0]["message"]["content"], None))
    except Exception as err:  # noqa: BLE001 - recorded, and the test fails on it
        results.append(("error", repr(err), None))


def test_sigterm_under_load_finishes_in_flight_requests_and_exits_cleanly():
    server = ServerProcess(
        FAKE_SERVER,
        "--kind",
        "generate",
        "--delay",
        "0.1",
        "--port",
        "0",
        "--max-batch-size",
        "4",
        "--grace-period",
        "10",
        "--load-delay",
        "0.5",
    )
    try:
        statuses = server.wait_ready()
        assert [s for s in statuses if s][0] == 503 and statuses[-1] == 200  # 503 while "loading", then ready
        results: list = []
        threads = [threading.Thread(target=chat, args=(server.url, f"req {i}", 10, results, i == 0)) for i in range(6)]
        for t in threads:
            t.start()
        server.wait_in_flight(6)  # 4 running (1 s each), 2 queued behind them
        children = psutil.Process(server.proc.pid).children(recursive=True)
        server.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        server.wait_draining()
        refused = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "late"}], "max_tokens": 2},
        )
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        assert httpx.get(f"{server.url}/readyz").status_code == 503
        assert httpx.get(f"{server.url}/livez").status_code == 200
        for t in threads:
            t.join(30)
        rc = server.proc.wait(15)
        elapsed = time.monotonic() - signalled
        assert rc == 0, "".join(server.log)
        assert elapsed < 10, elapsed  # within the grace period
        expected = "".join(f" w{i}" for i in range(10))
        assert Counter(results) == Counter([(200, expected, "[DONE]")] + [(200, expected, None)] * 5), results
        assert not psutil.pid_exists(server.proc.pid)
        assert all(not c.is_running() for c in children)
        assert any("finishing" in line for line in server.log)
    finally:
        server.stop()


def test_grace_period_bounds_the_exit():
    server = ServerProcess(FAKE_SERVER, "--kind", "generate", "--delay", "0.1", "--port", "0", "--grace-period", "2")
    try:
        server.wait_ready()
        results: list = []
        worker = threading.Thread(target=chat, args=(server.url, "long", 200, results), daemon=True)  # ~20 s
        worker.start()
        server.wait_in_flight(1)
        server.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        rc = server.proc.wait(15)
        assert rc == 0
        assert time.monotonic() - signalled < 2 + 1.5  # grace period plus a little for the teardown
        assert any("grace period over" in line for line in server.log)
    finally:
        server.stop()


@pytest.mark.parametrize("module", ["accelab.serve"])
def test_cli_entry_rejects_a_bad_model_before_listening(module):
    proc = subprocess.run(
        [sys.executable, "-m", module, "no-such-model", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert "unknown model 'no-such-model'" in proc.stderr and "listening" not in proc.stderr


def test_commands_register_on_a_typer_app():
    import typer
    from typer.testing import CliRunner

    from accelab.loadtest.commands import register as register_loadtest
    from accelab.serve.commands import register as register_serve

    app = typer.Typer()
    register_serve(app)
    register_loadtest(app)
    serve_help = CliRunner().invoke(app, ["serve", "--help"], terminal_width=200)
    assert serve_help.exit_code == 0
    for option in (
        "--plan",
        "--max-batch-size",
        "--max-wait-ms",
        "--max-queue",
        "--request-timeout",
        "--grace-period",
        "--api-key",
        "ACCELAB_API_KEY",
        "--max-body-bytes",
        "--max-tokens",
    ):
        assert option in serve_help.output, option
    loadtest_help = CliRunner().invoke(app, ["loadtest", "--help"], terminal_width=200)
    for option in ("--rate", "--concurrency", "--burstiness", "--find-max", "--slo", "--warmup", "--plot"):
        assert option in loadtest_help.output, option
