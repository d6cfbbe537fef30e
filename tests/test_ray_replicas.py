"""`accelab serve --replicas 2` on a real local Ray instance with the real MiniLM: both
replicas serve, one replica's process is killed mid-load, and every request gets exactly one
answer (a retry on the other replica, or a 503 with Retry-After); Ray restarts the replica,
and /metrics shows both under one schema, labelled by replica."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from accelab.catalog.fetch import is_fetched

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray", reason="pip install 'accelab[ray]' (make test installs it)")

USERS = 6
PER_USER = 40


def metric_values(url: str, name: str) -> dict[str, float]:
    """{replica: value} of one series per replica (summed over its other labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name:
                values[sample.labels["replica"]] = values.get(sample.labels["replica"], 0.0) + sample.value
    return values


def replica_pids(url: str) -> dict[str, int]:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        if family.name == "accelab_replica_info":
            return {s.labels["replica"]: int(s.labels["pid"]) for s in family.samples}
    return {}


@pytest.fixture(scope="module")
def server():
    if not is_fetched("minilm-l6"):
        pytest.skip("run `accelab models fetch minilm-l6` first")
    with __import__("socket").socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # its own session: the Ray processes it starts must not get this terminal's signals
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "accelab.serve",
            "minilm-l6",
            "--replicas",
            "2",
            "--port",
            str(port),
            "--set",
            "threads=1",
            "--max-batch-size",
            "8",
            "--request-timeout",
            "30",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(f"{url}/readyz", timeout=5).status_code == 200 and len(replica_pids(url)) == 2:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        else:
            raise AssertionError("the replicas were not ready in 240 s")
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
                subprocess.run(
                    [sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"], capture_output=True, check=False
                )


def test_two_replicas_serve_and_a_killed_one_loses_no_request(server):
    url, proc = server
    reference = np.array(
        httpx.post(f"{url}/v1/embeddings", json={"input": "reference text"}).json()["data"][0]["embedding"]
    )
    answers: dict[int, list[httpx.Response]] = {}
    killed: list[int] = []

    async def user(client: httpx.AsyncClient, u: int) -> None:
        for k in range(PER_USER):
            i = u * PER_USER + k
            text = "reference text" if i % 10 == 0 else f"request number {i}"
            response = await client.post("/v1/embeddings", json={"input": text})
            answers.setdefault(i, []).append(response)

    async def killer() -> None:
        # a quarter of the way through, and once both replicas have served (the router may send the
        # first requests to one of them; it must use both before half the load is sent)
        before: dict[str, float] = {}
        while len(answers) < USERS * PER_USER // 2:
            if len(answers) >= USERS * PER_USER // 4:
                before = await asyncio.to_thread(metric_values, url, "accelab_requests_total")
                if len(before) == 2 and all(v > 0 for v in before.values()):
                    break
            await asyncio.sleep(0.05)
        assert len(before) == 2 and all(v > 0 for v in before.values()), before  # both replicas served
        replica, pid = sorted(replica_pids(url).items())[0]
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    async def load() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            await asyncio.gather(killer(), *(user(client, u) for u in range(USERS)))

    asyncio.run(load())
    assert killed
    # every request: exactly one answer, a 200 with the right vector or a clear 503
    assert sorted(answers) == list(range(USERS * PER_USER))
    assert all(len(a) == 1 for a in answers.values())
    codes = [a[0].status_code for a in answers.values()]
    assert set(codes) <= {200, 503}, set(codes)
    for i, (response,) in answers.items():
        if response.status_code == 503:
            assert response.headers["retry-after"] and "replica" in response.json()["error"]["message"]
        elif i % 10 == 0:
            vector = np.array(response.json()["data"][0]["embedding"])
            assert np.abs(vector - reference).max() < 1e-5
    assert codes.count(200) >= len(codes) - USERS  # at most one in-flight request per user could be lost to a 503
    # the front counts what it did: every 503 is a request lost after its retry died too
    from prometheus_client.parser import text_string_to_metric_families

    front = {
        (s.name, tuple(s.labels.items())): s.value
        for f in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text)
        for s in f.samples
    }
    lost = front[("accelab_replica_lost_requests_total", (("when", "before_answer"),))]
    assert lost == codes.count(503) and front[("accelab_replica_retries_total", ())] >= lost
    assert front[("accelab_replicas_configured", ())] == 2

    # Ray starts a new replica in the dead one's place; /metrics shows two again, the dead one gone
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        pids = replica_pids(url)
        if len(pids) == 2 and killed[0] not in pids.values():
            break
        time.sleep(1)
    assert len(pids) == 2 and killed[0] not in pids.values(), pids
    after = httpx.post(f"{url}/v1/embeddings", json={"input": "reference text"}).json()
    assert np.abs(np.array(after["data"][0]["embedding"]) - reference).max() < 1e-5

    proc.send_signal(signal.SIGTERM)  # drains, stops the replicas and the local Ray instance
    assert proc.wait(90) == 0
