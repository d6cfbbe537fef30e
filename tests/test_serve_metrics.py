"""serve/metrics.py: one registry per app, every metric the brief names, GPU gauges where a
GPU exists (faked here: torch.cuda answers as if one did)."""

from __future__ import annotations

import torch

from accelab.serve.metrics import ServeMetrics


def test_two_apps_do_not_collide_and_every_metric_is_exported():
    a, b = ServeMetrics(), ServeMetrics()
    a.generated_tokens.inc(5)
    text = a.render().decode()
    assert "accelab_generated_tokens_total 5.0" in text
    assert "accelab_generated_tokens_total 0.0" in b.render().decode()
    for name in (
        "accelab_request_latency_seconds",
        "accelab_queue_time_seconds",
        "accelab_compute_time_seconds",
        "accelab_time_to_first_token_seconds",
        "accelab_time_per_output_token_seconds",
        "accelab_batch_size",
        "accelab_queue_depth",
        "accelab_errors_total",
        "accelab_batch_retries_total",
        "accelab_process_resident_memory_bytes",
        "accelab_ready",
        "accelab_requests_in_flight",
    ):
        assert f"# TYPE {name.removesuffix('_total')}" in text, name
    assert 'accelab_errors_total{kind="queue_full"} 0.0' in text  # zeros exported from the start
    rss = next(line for line in text.splitlines() if line.startswith("accelab_process_resident_memory_bytes "))
    assert float(rss.split()[-1]) > 10e6
    assert "gpu" not in text  # no GPU here: no GPU series


def test_gpu_memory_gauges_when_a_gpu_exists(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda i: 1000 + i)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i: 2000 + i)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda i: 3000 + i)
    text = ServeMetrics().render().decode()
    assert 'accelab_gpu_memory_allocated_bytes{device="1"} 1001.0' in text
    assert 'accelab_gpu_memory_reserved_bytes{device="0"} 2000.0' in text
    assert 'accelab_gpu_memory_peak_bytes{device="0"} 3000.0' in text


def test_replicas_metrics_merge_under_one_schema_labelled_by_replica():
    from prometheus_client.parser import text_string_to_metric_families

    from accelab.serve.metrics import ServeMetrics
    from accelab.serve.replica_front import merge_metrics

    a, b = ServeMetrics(), ServeMetrics()
    a.requests.labels(route="embeddings", status="200").inc(3)
    b.requests.labels(route="embeddings", status="200").inc(5)
    b.ready.set(1)
    merged = merge_metrics({"r1": (a.render().decode(), 101), "r2": (b.render().decode(), 202)}).decode()
    families = {f.name: f for f in text_string_to_metric_families(merged)}  # parses: one valid exposition
    requests = {
        s.labels["replica"]: s.value
        for s in families["accelab_requests"].samples
        if s.name == "accelab_requests_total" and s.labels.get("status") == "200"
    }
    assert requests == {"r1": 3.0, "r2": 5.0}
    assert {s.labels["replica"]: s.value for s in families["accelab_ready"].samples} == {"r1": 0.0, "r2": 1.0}
    assert merged.count("# TYPE accelab_requests_total counter") == 1  # one schema, not one per replica
    info = {s.labels["replica"]: s.labels["pid"] for s in families["accelab_replica_info"].samples}
    assert info == {"r1": "101", "r2": "202"}
