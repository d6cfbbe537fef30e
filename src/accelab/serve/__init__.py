"""`accelab serve`: an HTTP server for a model under a plan.

Layout, request path first:
  middleware.py   API key (401), draining (503), body size (413), in-flight count, per-route metrics
  routes_*.py     OpenAI-compatible routes (schemas.py validates; errors.py shapes refusals)
  dispatch.py     prepare inputs, submit a job (429), wait with the deadline (504)
  worker.py       the model thread: batches from batcher.py (pure), OOM split-and-retry
  engines/        what runs a batch: generation, embeddings, classification over a Runnable
  state.py, app.py, server.py   background load and readiness, the app, uvicorn and SIGTERM
  metrics.py      every Prometheus metric (the FAKE engines and test servers live in tests/)
"""
