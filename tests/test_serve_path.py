"""The one table of how `accelab serve` runs a plan (accelab.runtimes.serve_path): the engine
that wraps the model and who schedules its work, per runtime and task."""

from __future__ import annotations

import pytest

from accelab.catalog.resolve import resolve
from accelab.plan.plan import load_plan
from accelab.runtimes import ServePath, serve_path


@pytest.mark.parametrize(
    ("model", "plan", "expected"),
    [
        ("smollm2-135m", "baseline", ServePath(engine="generation", worker="continuous", steps="torch")),
        ("smollm2-135m", "bf16", ServePath(engine="generation", worker="continuous", steps="torch")),
        ("smollm2-135m", "llamacpp", ServePath(engine="generation", worker="continuous", steps="llamacpp")),
        ("smollm2-135m", "vllm", ServePath(engine="engine-process", worker="engine")),
        ("smollm2-135m", "openvino-int8", ServePath(engine="engine-process", worker="engine")),
        ("smollm2-135m", "onnxruntime", ServePath(engine="generation", worker="batches")),
        ("smolvlm-tiny", "baseline", ServePath(engine="generation", worker="continuous", steps="torch")),
        ("minilm-l6", "baseline", ServePath(engine="embedding", worker="batches")),
        ("minilm-l6", "openvino", ServePath(engine="embedding", worker="batches")),
        ("vit-tiny", "baseline", ServePath(engine="classification", worker="batches")),
    ],
)
def test_each_plan_has_one_serve_path(model, plan, expected):
    assert serve_path(resolve(model, fetch=False), load_plan(plan)) == expected


@pytest.mark.parametrize(("worker", "continuous"), [("continuous", True), ("batches", False)])
def test_the_server_starts_the_worker_its_engine_s_serve_path_names(worker, continuous, caplog):
    """The engine carries its serve path's worker (build_engine passes ServePath.worker on); the
    server starts that one: a generation engine whose path says "batches" runs per batch even
    though it could step sequences."""
    import httpx
    from fakes_serve import FakeGenerationEngine
    from serving import running_server

    from accelab.serve.app import create_app
    from accelab.serve.config import ServeConfig
    from accelab.serve.continuous import ContinuousWorker

    engine = FakeGenerationEngine(name="fake")
    engine.worker = worker
    app = create_app(ServeConfig(model_name="fake"), lambda: engine, stop_timeout_s=5)
    with caplog.at_level("INFO"), running_server(app) as url:
        body = {"model": "fake", "messages": [{"role": "user", "content": "a b"}], "max_tokens": 3}
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == " w0 w1 w2"
        assert isinstance(app.state.accelab.continuous, ContinuousWorker) is continuous
    assert (engine.batches == []) is continuous  # the batch worker's generate calls, or none
    said = "per-batch worker for fake (its runtime has no step engine)"
    assert any(said in r.getMessage() for r in caplog.records) is not continuous


@pytest.mark.slow
@pytest.mark.parametrize(("model", "plan"), [("smollm2-135m", "baseline"), ("minilm-l6", "baseline")])
def test_build_engine_gives_the_engine_its_serve_path_s_worker(model, plan):
    import torch

    from accelab.catalog.fetch import is_fetched
    from accelab.serve.engines import build_engine

    if not is_fetched(model):
        pytest.skip(f"run `accelab models fetch {model}` first (make test does)")
    spec, the_plan = resolve(model, fetch=False), load_plan(plan)
    engine = build_engine(spec, the_plan, torch.device("cpu"), name=model)
    try:
        assert engine.worker == serve_path(spec, the_plan).worker
    finally:
        engine.close()
