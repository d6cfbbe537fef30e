"""schemathesis fuzzes a real server from its own /openapi.json: requests generated from the
schema (the coverage phase's boundary values, then random ones) against each route family, on
the torch and llama.cpp engines, with schemathesis' checks that no answer is a server error and
that every status, content type and body is the one the schema documents. Each run is bounded in
time; a failure prints schemathesis' report with the curl that reproduces it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from accelab.catalog.fetch import is_fetched

pytestmark = pytest.mark.slow

ST = Path(sys.executable).parent / "st"
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"
FAMILIES = {  # id: (model, plan, routes regex, seconds of fuzzing)
    "generation-torch": ("smollm2-135m", "baseline", "^/v1/(chat/)?completions$", 45),
    "generation-llamacpp": ("smollm2-135m", "llamacpp", "^/v1/(chat/)?completions$", 30),
    "embeddings": ("minilm-l6", "baseline", "^/v1/embeddings$|^/(readyz|health|livez|metrics|v1/models)$", 20),
    "classification": ("vit-tiny", "baseline", "^/v1/classify$", 20),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_no_generated_request_gets_a_server_error_or_an_undocumented_answer(family):
    from serving import running_server

    from accelab.catalog.resolve import resolve
    from accelab.plan.plan import load_plan
    from accelab.serve.app import create_app
    from accelab.serve.config import ServeConfig
    from accelab.serve.server import engine_factory

    model, plan, routes, seconds = FAMILIES[family]
    if not is_fetched(model):
        pytest.skip(f"run `accelab models fetch {model}` first")
    factory = engine_factory(resolve(model, fetch=False), load_plan(plan), torch.device("cpu"), name=model)
    config = ServeConfig(model_name=model, max_tokens=16, max_batch_size=4)
    with running_server(create_app(config, factory), ready_timeout_s=300) as url:
        done = subprocess.run(
            [
                str(ST),
                "run",
                f"{url}/openapi.json",
                "--checks",
                CHECKS,
                "--max-time",
                str(seconds),
                "--include-path-regex",
                routes,
                "--request-timeout",
                "300",
                "--seed",
                "1",
                "--no-color",
            ],  # fmt: skip
            capture_output=True,
            text=True,
            timeout=seconds + 600,  # a long generated prompt on a busy machine may take minutes
            check=False,
        )
    report = done.stdout + done.stderr
    assert done.returncode == 0, report[-6000:]
    # its summary: no failures (warnings, e.g. a random `model` name answered 404, are not failures)
    assert re.search(r"=+ (No issues found|\d+ warnings?) in [\d.]+s =+", report), report[-3000:]
    assert re.search(r"(\d+) generated, \1 passed", report), report[-3000:]
