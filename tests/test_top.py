"""`accelab top`'s arithmetic and screen without a server: Prometheus' histogram_quantile on
hand-computed buckets, rates and percentiles of a window (a server restart included), which
rows an encoder and a generation server get, and the frames it draws from real ServeMetrics
expositions fed through a fake fetch and clock. (tests/test_monitoring.py runs it in tmux
against real servers and compares its numbers with a real Prometheus.)"""

from __future__ import annotations

import math

import pytest

from accelab.monitor.scrape import Snapshot, Window, quantile
from accelab.monitor.top import TopOptions, run_top, state_rows, traffic_rows
from accelab.serve.metrics import ServeMetrics

INF = math.inf


@pytest.mark.parametrize(
    ("q", "buckets", "expected"),
    [
        (0.5, [(0.1, 0), (0.5, 10), (1.0, 20), (INF, 20)], 0.5),  # rank 10 ends the 0.1-0.5 bucket
        (0.99, [(0.1, 0), (0.5, 10), (1.0, 20), (INF, 20)], 0.99),  # 9.8 of the 10 in 0.5-1: 0.5 + 0.5 * 0.98
        (0.25, [(0.1, 10), (INF, 10)], 0.025),  # the first bucket starts at 0
        (0.9, [(1.0, 5), (INF, 10)], 1.0),  # in +Inf: the largest finite bound
        (0.5, [(0.1, 4), (0.2, 3), (INF, 8)], 0.1),  # a bucket lagging the one below (a torn scrape) is raised to it
        (0.5, [(0.1, 0), (INF, 0)], None),  # no observation
        (0.5, [(0.1, 3), (1.0, 5)], None),  # no +Inf bucket: not a histogram
    ],
)
def test_quantile_is_prometheus_histogram_quantile(q, buckets, expected):
    got = quantile(q, buckets)
    assert got == (None if expected is None else pytest.approx(expected))


def exposition(
    *, requests: int = 0, ttft: tuple[float, ...] = (), errors: int = 0, kv: bool = False, generated: int = 0
) -> str:
    m = ServeMetrics()
    m.configure(max_queue=64, model_name="m")
    for _ in range(requests):
        m.requests.labels(route="chat", status="200").inc()
        m.latency.labels(route="chat").observe(0.2)
    m.requests.labels(route="models", status="200").inc(7)  # /v1/models: not an API request
    for seconds in ttft:
        m.ttft.observe(seconds)
    m.errors.labels(kind="timeout").inc(errors)
    m.generated_tokens.inc(generated)
    if kv:
        m.kv_blocks.labels(state="used").set(3)
        m.kv_blocks.labels(state="free").set(13)
        m.running.set(2)
    m.info.labels(model="m", plan="baseline", device="cpu").set(1)
    m.ready.set(1)
    return m.render().decode()


def test_a_window_counts_what_happened_between_its_two_scrapes():
    old = Snapshot.parse(exposition(requests=3, ttft=(0.04,) * 3, generated=30), at=100.0)
    new = Snapshot.parse(exposition(requests=8, ttft=(0.04,) * 3 + (0.3,) * 5, errors=1, generated=80), at=102.0)
    window = Window(old=old, new=new)
    assert window.rate("accelab_requests_total", exclude={"route": ("models", "other")}) == 2.5
    assert window.rate("accelab_generated_tokens_total") == 25.0
    # the window's 5 first tokens were all at 0.3 s (in the 0.25-0.35 bucket); since start 3 of 8 were fast
    assert window.quantile(0.5, "accelab_time_to_first_token_seconds") == pytest.approx(0.25 + 0.1 * 2.5 / 5)
    assert quantile(0.5, new.buckets("accelab_time_to_first_token_seconds")) == pytest.approx(0.25 + 0.1 * 1 / 5)
    # the server restarted: its counters start again from zero, and the window takes the new counts
    restarted = Snapshot.parse(exposition(requests=2, ttft=(0.04, 0.04)), at=104.0)
    after = Window(old=new, new=restarted)
    assert after.increase("accelab_requests_total", exclude={"route": ("models", "other")}) == 2
    assert after.quantile(0.5, "accelab_time_to_first_token_seconds") == pytest.approx(0.025 + 0.025 * 0.5)


def test_rows_of_a_generation_server_and_of_an_encoder():
    gen = Snapshot.parse(exposition(requests=4, ttft=(0.1,) * 4, kv=True, generated=40), at=1.0)
    rows = {r[0]: r[1:] for r in traffic_rows(None, gen)}
    assert rows["requests"] == ("-", "4")  # one scrape: no window yet
    # 4 at 0.1 s, in the 0.075-0.1 bucket: p50 0.075 + 0.025 * 2/4, p99 0.075 + 0.025 * 3.96/4 = 99.75 ms
    assert rows["time to first token p50 · p99"][1] == "87.5 ms · 99.8 ms"
    assert rows["tokens generated"] == ("-", "40 (prompt 0)")
    now = dict(state_rows(gen))
    assert now["KV cache"] == "3 of 16 blocks used (19%)"
    assert now["running"] == "2 sequences, 0 waiting"
    assert now["queue"] == "0 waiting of 64"
    encoder = Snapshot.parse(exposition(requests=4), at=1.0)
    rows = {r[0] for r in traffic_rows(None, encoder)}
    assert "time to first token p50 · p99" not in rows and "tokens in" in rows
    assert "KV cache" not in dict(state_rows(encoder))


def test_top_draws_the_window_and_keeps_its_numbers_when_the_server_goes_away(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")  # the frame's width, as a terminal would say it
    texts = iter([exposition(requests=3, ttft=(0.04,) * 3), exposition(requests=8, ttft=(0.04,) * 8, errors=2)])
    ticks = iter([10.0, 12.0, 14.0])

    def fetch(url: str) -> str:
        assert url == "http://127.0.0.1:9/metrics"
        try:
            return next(texts)
        except StopIteration:
            raise ConnectionError("connection refused") from None

    options = TopOptions(url="http://127.0.0.1:9", interval_s=0.01, window_s=5)
    assert run_top(options, fetch=fetch, clock=lambda: next(ticks), frames=2) == 0
    screen = capsys.readouterr().out
    assert "accelab top · http://127.0.0.1:9 · m (plan baseline, cpu) · ready" in screen
    assert (
        "cannot read http://127.0.0.1:9/metrics: ConnectionError: connection refused (retrying every 0.01 s)" in screen
    )
    requests = next(line for line in screen.splitlines() if line.strip().startswith("requests"))
    assert [cell.strip() for cell in requests.split("│")] == ["requests", "2.50/s", "8"]  # /v1/models left out
    errors = next(line for line in screen.splitlines() if line.strip().startswith("errors"))
    assert "1.00/s (40.0%)" in errors and "2 (timeout 2)" in errors


def test_options_say_what_is_wrong():
    with pytest.raises(ValueError, match="URL '127.0.0.1:8000' is not an http"):
        TopOptions(url="127.0.0.1:8000")
    with pytest.raises(ValueError, match="window_s=0.5 is shorter than interval_s=1; a window needs two scrapes"):
        TopOptions(url="http://x", interval_s=1, window_s=0.5)
    with pytest.raises(ValueError, match="interval_s=0 must be more than 0"):
        TopOptions(url="http://x", interval_s=0)


def test_a_server_that_is_not_there_is_said_before_the_screen_is_taken(capsys):
    def refuse(url: str) -> str:
        raise ConnectionError("connection refused")

    assert run_top(TopOptions(url="http://127.0.0.1:9"), fetch=refuse, frames=1) == 1
    assert capsys.readouterr().err == (
        "cannot read http://127.0.0.1:9/metrics: ConnectionError: connection refused; "
        "is `accelab serve` running there?\n"
    )
