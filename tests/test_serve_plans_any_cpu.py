"""Every own-engine plan the serving tune can pick, and every one the README's and docs/serving.md's tables show,
starts and answers a chat on an AVX2-only CPU's paths (ACCELAB_CPU_ISA=avx2, whatever this CPU is),
with continuous batching on: the best plan on AMX, int8-bf16 compiled with an int8 head,
once crashed an AVX2 server at start-up after turning continuous batching off. A compiled plan
whose operator this CPU lacks steps eager and says why; the float32 int8 plans run the AVX2 int8
operator, compiled where the plan compiles.

The runtimes built for the host (llama.cpp, vLLM, OpenVINO GenAI) are out of the override's reach:
their plans are served on this CPU by tests/test_openai_llamacpp.py, test_vllm_e2e.py and
test_openvino_genai_e2e.py. A two-layer Llama with SmolLM2's tokenizer and chat template stands in
for the model (the paths are the same at any size; compiling 30 layers would take minutes a plan)."""

from __future__ import annotations

import httpx
import pytest
from serving import ServerProcess
from tiny_models import tiny_smollm2

from accelab.catalog.fetch import is_fetched
from accelab.catalog.store import model_dir
from accelab.plan.plan import load_plan
from accelab.tuner.serving import SERVE_CANDIDATES

pytestmark = [pytest.mark.slow, pytest.mark.cpu_kind]

# the README's serving tables name these besides the tune's candidates
README_PLANS = ("bf16[compile=default]", "int8-bf16[compile=default;quantize_head=true]", "int8-bf16")
PLANS = sorted({k for k in (*SERVE_CANDIDATES, *README_PLANS) if load_plan(k).backend == "torch"})


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """SmolLM2's architecture at two layers of 64, random weights, its own tokenizer and template."""
    if not is_fetched("smollm2-135m"):
        pytest.skip("run `accelab models fetch smollm2-135m` first (make test does)")
    return tiny_smollm2(tmp_path_factory.mktemp("tiny-smollm2"), model_dir("smollm2-135m"))


@pytest.fixture(scope="module")
def servers(tiny_llama):
    """One server per plan, all started at once (their loads and compiles overlap), one thread each."""
    env = {"ACCELAB_CPU_ISA": "avx2", "OMP_NUM_THREADS": "1"}
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    started = {}
    try:
        for plan in PLANS:
            started[plan] = ServerProcess(
                "-m", "accelab", "serve", str(tiny_llama), "--plan", plan, "--port", "0", timeout_s=180, env=env
            )
        for server in started.values():
            server.wait_ready(600)
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.mark.parametrize("plan", PLANS)
def test_the_plan_serves_continuously_on_avx2(servers, tiny_llama, plan):
    server = servers[plan]
    body = {
        "model": str(tiny_llama),
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 4,
        "temperature": 0,
    }
    answer = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 4
    log = "".join(server.log)
    assert "CPU avx2" in log, log[-3000:]  # the level the server ran at (capped, where this CPU is bigger)
    assert "continuous batching is off" not in log and "continuous batching:" in log, log[-3000:]
    compiles = load_plan(plan).compile != "off"
    int8_bf16 = load_plan(plan).quantization == "int8-weight" and load_plan(plan).precision.startswith("bf16")
    if compiles and int8_bf16:  # the AMX operator is missing: eager steps, and the log says why
        assert "the plan compiles, but the continuous steps run eager" in log, log[-3000:]
        assert "AMX" in log
    elif compiles:
        assert "steps compiled" in log, log[-3000:]
