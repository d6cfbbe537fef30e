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
