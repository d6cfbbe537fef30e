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
    for name in ("accelab_request_latency_seconds", "accelab_queue_time_seconds", "accelab_compute_time_seconds",
                 "accelab_time_to_first_token_seconds", "accelab_time_per_output_token_seconds",
                 "accelab_batch_size", "accelab_queue_depth", "accelab_errors_total", "accelab_batch_retries_total",
                 "accelab_process_resident_memory_bytes", "accelab_ready", "accelab_requests_in_flight"):
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
