"""The pure parts of the load tester: arrival schedules, SLO parsing, summaries, find-max."""

from __future__ import annotations

import statistics

import pytest

from accelab.loadtest.findmax import find_max, goodput_at_least
from accelab.loadtest.schedule import arrival_times
from accelab.loadtest.summary import SLO, RequestRecord, parse_slo, summarize_run


def test_poisson_schedule_has_the_asked_rate_and_is_seeded():
    times = arrival_times(50.0, n=4000, seed=1)
    assert len(times) == 4000 and times == sorted(times)
    gaps = [b - a for a, b in zip([0.0, *times], times)]
    assert statistics.fmean(gaps) == pytest.approx(1 / 50, rel=0.05)
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, rel=0.1)  # exponential: cv 1
    assert arrival_times(50.0, n=10, seed=1) == times[:10]
    assert arrival_times(50.0, n=10, seed=2) != times[:10]


def test_burstiness_changes_the_spread_not_the_rate():
    bursty = arrival_times(20.0, n=4000, burstiness=0.25, seed=0)
    even = arrival_times(20.0, n=4000, burstiness=8.0, seed=0)
    for times, cv in ((bursty, 2.0), (even, 1 / 8**0.5)):
        gaps = [b - a for a, b in zip([0.0, *times], times)]
        assert statistics.fmean(gaps) == pytest.approx(1 / 20, rel=0.08)
        assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(cv, rel=0.12)


def test_schedule_bounded_by_duration_and_count():
    assert max(arrival_times(100.0, duration_s=2.0)) < 2.0
    assert len(arrival_times(100.0, n=7, duration_s=100.0)) == 7
    with pytest.raises(ValueError, match="bound the schedule"):
        arrival_times(1.0)
    with pytest.raises(ValueError, match="rate=0"):
        arrival_times(0.0, n=1)


def test_parse_slo():
    slo = parse_slo("ttft=500ms, e2e=2s,tpot=0.05")
    assert slo == SLO(ttft=0.5, e2e=2.0, tpot=0.05)
    assert slo.describe() == "ttft=500ms,tpot=50ms,e2e=2000ms"
    with pytest.raises(ValueError, match="KEY=TIME"):
        parse_slo("latency=1s")
    with pytest.raises(ValueError, match="500ms"):
        parse_slo("ttft=fast")


def rec(start, e2e, ttft=None, tokens=0, status="200", chunks=()):
    return RequestRecord(
        start=start,
        end=start + e2e,
        status=status,
        ttft=ttft,
        output_tokens=tokens,
        chunk_times=[start + c for c in chunks],
    )


def test_summary_percentiles_throughput_and_goodput():
    records = [rec(i * 0.1, 0.2 + 0.01 * i, ttft=0.05, tokens=11, chunks=[0.05, 0.07, 0.10]) for i in range(10)]
    records.append(rec(1.0, 0.01, status="429"))
    records.append(rec(1.0, 2.5, ttft=1.0, tokens=11))  # ok but misses the SLO
    s = summarize_run(records, parse_slo("ttft=500ms,e2e=1s"), offered_rate=10.0)
    assert s["requests"] == 12 and s["ok"] == 11 and s["errors_by_status"] == {"429": 1}
    assert s["good_requests"] == 10
    assert s["goodput_fraction"] == pytest.approx(10 / 12)
    assert s["duration_s"] == pytest.approx(3.5)
    assert s["request_throughput"] == pytest.approx(11 / 3.5)
    assert s["goodput_rate"] == pytest.approx(10 / 3.5)
    assert s["output_token_throughput"] == pytest.approx(121 / 3.5)
    assert s["ttft_ms"]["p50"] == pytest.approx(50)
    assert s["e2e_ms"]["max"] == pytest.approx(2500)
    assert s["tpot_ms"]["min"] == pytest.approx((200 - 50) / 10)  # (e2e - ttft) / (tokens - 1)
    # 11 tokens in 3 chunks: the 10 after the first chunk spread over its 2 gaps (20 and 30 ms)
    assert s["itl_ms"]["n"] == 100 and s["itl_ms"]["min"] == pytest.approx(4)
    assert s["itl_ms"]["max"] == pytest.approx(6)


def test_itl_is_per_token_from_the_usage_count_not_per_chunk():
    one_per_chunk = rec(0, 1.0, ttft=0.1, tokens=4, chunks=[0.1, 0.2, 0.4, 0.5])
    assert one_per_chunk.itls == pytest.approx([0.1, 0.2, 0.1])
    # 7 tokens in 3 chunks (text held back, then sent together): 6 tokens over 2 gaps
    held = rec(0, 1.0, ttft=0.1, tokens=7, chunks=[0.1, 0.4, 0.7])
    assert held.itls == pytest.approx([0.1] * 6)
    uneven = rec(0, 1.0, ttft=0.1, tokens=4, chunks=[0.1, 0.3, 0.4])  # 3 tokens over 2 gaps: 2 then 1
    assert uneven.itls == pytest.approx([0.1, 0.1, 0.1]) and len(uneven.itls) == 3
    no_usage = rec(0, 1.0, ttft=0.1, tokens=0, chunks=[0.1, 0.3])
    assert no_usage.itls == pytest.approx([0.2])


def test_mixed_max_tokens_cycle_through_the_requests():
    from accelab.loadtest.client import LoadConfig, _Sender, parse_max_tokens

    assert parse_max_tokens("32") == 32
    assert parse_max_tokens("16, 128,32") == (16, 128, 32)
    with pytest.raises(ValueError, match="comma-separated list"):
        parse_max_tokens("16;128")
    config = LoadConfig(url="127.0.0.1:1", inputs=("hi",), concurrency=1, max_tokens=(16, 128, 32))
    sender = _Sender(config, session=None, model="m")
    assert [sender.body(i)["max_tokens"] for i in range(5)] == [16, 128, 32, 16, 128]
    with pytest.raises(ValueError, match="must be 1 or more"):
        LoadConfig(url="127.0.0.1:1", inputs=("hi",), concurrency=1, max_tokens=(16, 0))


def test_not_streamed_requests_use_e2e_for_ttft_in_the_slo():
    slo = parse_slo("ttft=100ms")
    assert slo.met_by(rec(0, 0.08))
    assert not slo.met_by(rec(0, 0.2))
    assert not slo.met_by(rec(0, 0.01, status="500"))


class FakeServer:
    """Goodput falls off past a capacity: a stand-in for measuring a real server."""

    def __init__(self, capacity: float):
        self.capacity = capacity
        self.rates: list[float] = []

    def measure(self, rate: float) -> dict:
        self.rates.append(rate)
        return {"goodput_fraction": 1.0 if rate <= self.capacity else max(0.0, 1 - (rate - self.capacity) / rate)}


@pytest.mark.parametrize("capacity", [3.0, 37.0, 100.0, 0.3])
def test_find_max_converges_to_the_capacity(capacity):
    server = FakeServer(capacity)
    result = find_max(server.measure, goodput_at_least(0.95), start_rate=1.0, max_steps=20, rel_tol=0.02)
    assert result.best_rate <= capacity / 0.95 + 1e-9  # any rate within the goodput tolerance passes
    assert result.best_rate >= capacity * 0.97
    assert result.saturated and result.lowest_failing > result.best_rate
    assert (result.lowest_failing - result.best_rate) / result.best_rate <= 0.02
    assert len(server.rates) <= 20


def test_find_max_brackets_by_doubling_then_bisects():
    server = FakeServer(10.0)
    result = find_max(server.measure, goodput_at_least(1.0), start_rate=1.0, max_steps=8, rel_tol=0.01)
    assert server.rates[:5] == [1.0, 2.0, 4.0, 8.0, 16.0]
    assert server.rates[5:] == [12.0, 10.0, 11.0]  # bisect within [8, 16]
    assert result.best_rate == 10.0 and len(result.probes) == 8


def test_find_max_reports_when_it_never_saturates():
    result = find_max(FakeServer(1e9).measure, goodput_at_least(0.95), start_rate=1.0, max_steps=4)
    assert result.best_rate == 8.0 and not result.saturated


def test_find_max_reports_when_nothing_passes():
    result = find_max(lambda rate: {"goodput_fraction": 0.0}, goodput_at_least(0.95), start_rate=1.0, max_steps=5)
    assert result.best_rate is None and [p.rate for p in result.probes] == [1.0, 0.5, 0.25, 0.125, 0.0625]


def test_images_from_the_samples_generated_or_a_folder(tmp_path):
    import base64
    import io

    from PIL import Image

    from accelab.loadtest.images import load_images

    assert load_images(None) == ()
    samples = load_images("sample:3")
    assert len(samples) == 3 and len(set(samples)) == 3 and samples[0].startswith("data:image/png;base64,")
    generated = load_images("generated:4", seed=1)
    assert len(set(generated)) == 4 and generated == load_images("generated:4", seed=1) != load_images("generated:4")
    first = Image.open(io.BytesIO(base64.b64decode(generated[0].split(",", 1)[1])))
    assert first.size == (224, 224)
    Image.new("RGB", (4, 4)).save(tmp_path / "a.jpg")
    (tmp_path / "notes.txt").write_text("not an image")
    assert [uri[:22] for uri in load_images(str(tmp_path))] == ["data:image/jpeg;base64"]
    with pytest.raises(ValueError, match="count after ':' must be a whole number"):
        load_images("generated:0")
    with pytest.raises(ValueError, match="not a folder, nor sample"):
        load_images(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no .png"):
        load_images(str(tmp_path / "empty"))


def test_a_chat_request_carries_its_share_of_the_image_pool():
    from accelab.loadtest.client import LoadConfig, _Sender

    config = LoadConfig(
        url="http://x", inputs=("hi", "yo"), concurrency=1, images=("A", "B", "C"), images_per_request=2
    )
    sender = _Sender(config, session=None, model="m")
    content = sender.body(1)["messages"][0]["content"]
    assert content[0] == {"type": "text", "text": "yo"}
    assert [part["image_url"]["url"] for part in content[1:]] == ["C", "A"]  # request 1: images 2 and 3 of the pool
    with pytest.raises(ValueError, match="--images goes with --endpoint chat"):
        LoadConfig(url="http://x", inputs=("hi",), concurrency=1, endpoint="completions", images=("A",))


def test_a_mixed_load_sends_images_on_every_nth_request_only():
    """--images-every 2: half the chats carry an image (the pool in turn), half are text only."""
    from accelab.loadtest.client import LoadConfig, _Sender

    config = LoadConfig(url="http://x", inputs=("hi",), concurrency=1, images=("A", "B"), images_every=2)
    sender = _Sender(config, session=None, model="m")
    contents = [sender.body(i)["messages"][0]["content"] for i in range(5)]
    assert [c if isinstance(c, str) else c[1]["image_url"]["url"] for c in contents] == ["A", "hi", "B", "hi", "A"]
    assert [sender.images_of(i) for i in range(4)] == [1, 0, 1, 0]
    with pytest.raises(ValueError, match="images_every=0"):
        LoadConfig(url="http://x", inputs=("hi",), concurrency=1, images=("A",), images_every=0)
