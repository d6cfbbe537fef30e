"""Watching a running `accelab serve`: `accelab top URL` reads its /metrics and shows, live, the
numbers a person on call asks for (requests/s, errors, latency percentiles, tokens/s, queue,
running sequences, KV cache, memory, replicas, retries). Prometheus and Grafana (deploy/) do
the same over time; `top` needs nothing but the server."""
