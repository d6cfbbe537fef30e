"""The load tester's HTTP driver against a real server on 127.0.0.1 (FAKE engines, so the
server's pace is known): streaming measurements, errors by status, the CLI with --json,
--plot and the results store."""

from __future__ import annotations

import json

import pytest
import typer
from fakes_serve import FakeEmbeddingEngine, FakeGenerationEngine
from serving import running_server
from typer.testing import CliRunner

from accelab.loadtest.client import LoadConfig, normalise_url, run_load
from accelab.loadtest.commands import register
from accelab.loadtest.summary import parse_slo, summarize_run
from accelab.results.store import open_store
from accelab.serve.app import create_app
from accelab.serve.config import ServeConfig


def serve(engine, **config):
    return running_server(create_app(ServeConfig(model_name="fake", **config), lambda: engine))


def test_open_loop_streaming_measures_ttft_tpot_itl_and_goodput():
    engine = FakeGenerationEngine(name="fake", delay_s=0.02)  # 20 ms per token
    with serve(engine, max_batch_size=8, max_wait_ms=2) as url:
        config = LoadConfig(
            url=url + "/v1/",
            endpoint="chat",
            inputs=("hello there", "a b c"),
            rate=20.0,
            requests=30,
            duration_s=10,
            max_tokens=6,
            warmup=1,
        )
        records = run_load(config, "fake")
        summary = summarize_run(records, parse_slo("ttft=2s,e2e=5s"), offered_rate=20.0)
    assert summary["requests"] == 30 and summary["ok"] == 30
    assert summary["output_tokens"] == 30 * 6
    assert all(r.output_tokens == 6 and r.prompt_tokens in (2, 3) for r in records)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = summary[key]
        assert stats["p50"] <= stats["p90"] <= stats["p99"]
    assert 15 <= summary["tpot_ms"]["p50"] <= 200  # the fake's 20 ms per token, plus noise
    assert summary["ttft_ms"]["p50"] < summary["e2e_ms"]["p50"]
    assert summary["goodput_fraction"] == 1.0
    assert summary["request_throughput"] == pytest.approx(30 / summary["duration_s"])


def test_closed_loop_counts_errors_by_status():
    engine = FakeEmbeddingEngine(name="fake", delay_s=0.2)
    with serve(engine, max_batch_size=1, max_queue=1) as url:
        config = LoadConfig(
            url=url, endpoint="embeddings", inputs=("x",), concurrency=6, requests=18, duration_s=20, warmup=0
        )
        summary = summarize_run(run_load(config, "fake"), parse_slo("e2e=10s"))
    assert summary["requests"] == 18
    assert summary["errors_by_status"].get("429", 0) > 0
    assert summary["ok"] + summary["errors_by_status"]["429"] == 18
    assert summary["goodput_fraction"] == pytest.approx(summary["ok"] / 18)


def test_cli_find_max_writes_json_plot_and_store(tmp_path):
    app = typer.Typer()
    register(app)
    engine = FakeEmbeddingEngine(name="fake", delay_s=0.05)  # one batch of up to 4 per 50 ms: ~80 req/s at most
    with serve(engine, max_batch_size=4, max_wait_ms=1, max_queue=512) as url:
        out = CliRunner().invoke(
            app,
            [
                url,
                "--endpoint",
                "embeddings",
                "--find-max",
                "--rate",
                "10",
                "--duration",
                "1",
                "--slo",
                "e2e=300ms",
                "--max-steps",
                "4",
                "--cooldown",
                "0",
                "--warmup",
                "1",
                "--json",
                str(tmp_path / "r.json"),
                "--plot",
                str(tmp_path / "r.png"),
                "--db",
                str(tmp_path / "results.db"),
                "--tag",
                "t1",
            ],
        )
    assert out.exit_code == 0, out.output
    assert "max sustainable rate" in out.output
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["kind"] == "loadtest" and result["workload"]["find_max"] is True
    probes = result["metrics"]["probes"]
    assert [p["rate"] for p in probes[:3]] == [10.0, 20.0, 40.0]
    assert result["metrics"]["max_rate"] in [p["rate"] for p in probes if p["passed"]]
    assert (tmp_path / "r.png").stat().st_size > 10_000
    [stored] = open_store(tmp_path / "results.db").query(kind="loadtest", tag="t1")
    assert stored.metrics["max_rate"] == result["metrics"]["max_rate"]
    assert stored.plan["name"] == "baseline"


def test_cli_single_run_prints_percentiles_and_plots_a_cdf(tmp_path):
    app = typer.Typer()
    register(app)
    with serve(FakeGenerationEngine(name="fake", delay_s=0.005)) as url:
        out = CliRunner().invoke(
            app,
            [
                url,
                "--concurrency",
                "2",
                "--requests",
                "8",
                "--max-tokens",
                "4",
                "--slo",
                "ttft=1s",
                "--plot",
                str(tmp_path / "cdf.png"),
                "--no-store",
            ],
        )
    assert out.exit_code == 0, out.output
    for label in ("TTFT p50", "ITL p50", "end-to-end p50", "goodput"):
        assert label in out.output
    assert (tmp_path / "cdf.png").stat().st_size > 10_000


def test_config_validation_and_url_normalisation():
    assert normalise_url("127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"
    with pytest.raises(ValueError, match="exactly one of --rate"):
        LoadConfig(url="x", inputs=("a",), rate=1.0, concurrency=2)
    with pytest.raises(ValueError, match="endpoint="):
        LoadConfig(url="x", inputs=("a",), endpoint="images", concurrency=1)


def test_transport_errors_are_counted_by_kind_not_raised():
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    refused = LoadConfig(
        url=f"127.0.0.1:{port}",
        endpoint="embeddings",
        inputs=("x",),
        concurrency=2,
        requests=4,
        duration_s=10,
        warmup=0,
        timeout_s=2,
    )
    records = run_load(refused, "fake")
    assert len(records) == 4 and {r.status for r in records} == {"error:ClientConnectorError"}
    assert all(r.error for r in records)

    engine = FakeEmbeddingEngine(name="fake", delay_s=1.0)
    with serve(engine, max_batch_size=1) as url:
        slow = LoadConfig(
            url=url,
            endpoint="embeddings",
            inputs=("x",),
            concurrency=1,
            requests=2,
            duration_s=10,
            warmup=0,
            timeout_s=0.3,
        )
        summary = summarize_run(run_load(slow, "fake"), parse_slo("e2e=10s"))
    assert summary["errors_by_status"] == {"error:Timeout": 2} and summary["ok"] == 0


def test_a_kept_alive_connection_the_server_closed_is_tried_again_once():
    """A real server that answers HTTP/1.1 keep-alive and then closes every connection after one
    answer (llama-server closes one after a few): the reused connection fails before any byte,
    and the request goes again on a fresh one; each request is sent at most twice."""
    import asyncio
    import socket
    import threading

    body = json.dumps({"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.5]}]})
    answer = (
        f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
    ).encode()
    received: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        )
        await reader.readexactly(length)
        received.append(1)
        writer.write(answer)
        await writer.drain()
        writer.close()  # no Connection: close header: the client keeps the connection for the next request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", port))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        config = LoadConfig(
            url=f"127.0.0.1:{port}",
            endpoint="embeddings",
            inputs=("x",),
            concurrency=1,
            requests=6,
            duration_s=10,
            warmup=0,
            timeout_s=5,
        )
        records = run_load(config, "fake")
    finally:
        loop.call_soon_threadsafe(server.close)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
    assert [r.status for r in records] == ["200"] * 6 and len(received) == 6


def test_embeddings_are_asked_for_as_base64_like_the_openai_client():
    from accelab.loadtest.client import _Sender

    config = LoadConfig(url="127.0.0.1:1", endpoint="embeddings", inputs=("a", "b"), rate=1.0)
    assert _Sender(config, None, "m").body(1) == {"model": "m", "input": "b", "encoding_format": "base64"}
