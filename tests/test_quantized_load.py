"""Plans that fit the machine. An int8 plan loads its model shard by shard, quantizing as it goes
(accelab.plan.quantized_load): the logits are those of loading the whole model and quantizing it
after, and the process never holds the full-precision model (its peak RSS, measured in a child
process of its own); a checkpoint whose names are not the model's loads the ordinary way and says
why. A plan that cannot fit is refused before loading with the figures (accelab.plan.fit), and
the server's KV cache is sized within the memory the weights leave. "The machine" is made small
with ACCELAB_AVAILABLE_MEMORY: a stand-in for a machine that an 8B would fill."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import httpx
import pytest
import torch

from accelab.catalog.fetch import is_fetched
from accelab.catalog.spec import ModelSpec
from accelab.catalog.store import model_dir
from accelab.plan import fit, quantized_load
from accelab.plan.plan import load_plan

pytestmark = pytest.mark.skipif(
    not is_fetched("smollm2-135m"), reason="run `accelab models fetch smollm2-135m` first (its tokenizer)"
)

# 8 layers of 1024 (127M parameters: 508 MB in fp32, ~130 MB once int8), its embedding tied to the head
SHAPE = dict(
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=8,
    vocab_size=2048,
    tie_word_embeddings=True,
)
FP32_MB = 508

CHILD = """
import json, sys, torch
import accelab.plan.techniques.quantization as q
from accelab.catalog.spec import ModelSpec
from accelab.plan.apply import apply_plan
from accelab.plan.plan import load_plan
source, whole = sys.argv[1], sys.argv[2] == "whole"
if whole:
    q.load = lambda *a, **k: None  # the ordinary way: load all of it, then quantize
plan = load_plan("int8-weight")
# what either way imports and builds once (torchao's kernels, the model's code) in, before the baseline
q.probe("int8-weight", torch.device("cpu"), torch.float32)
from transformers import AutoConfig, AutoModelForCausalLM
config = AutoConfig.from_pretrained(source)
config.num_hidden_layers, config.hidden_size, config.intermediate_size = 1, 64, 64
AutoModelForCausalLM.from_config(config)
def kib(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))
open("/proc/self/clear_refs", "w").write("5")  # the high-water mark starts again from what it holds now
base = kib("VmRSS")
runnable = apply_plan(ModelSpec(name="m", task="text-generation", source=source), plan, torch.device("cpu"))
peak = kib("VmHWM")
with torch.inference_mode():
    logits = runnable.model(torch.tensor([[1, 5, 9, 200, 7]])).logits[0, -1]
print(json.dumps({"peak_mb": (peak - base) / 1024, "sharded": runnable.quantized_on_load is not None,
                  "layers": runnable.quantized_layers, "notes": runnable.notes, "logits": logits.tolist()}))
"""


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """The shape above in bf16 safetensors shards of a layer each, SmolLM2's tokenizer beside it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("sharded")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SHAPE)).to(torch.bfloat16).save_pretrained(out, max_shard_size="20MB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((model_dir("smollm2-135m") / name).read_bytes())
    return out


def load_in_child(source, way: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(source), way], capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_an_int8_plan_loads_shard_by_shard_to_the_same_model_without_the_fp32_one_in_memory(sharded):
    assert len(quantized_load.shard_files(sharded)) >= 8
    whole, shards = load_in_child(sharded, "whole"), load_in_child(sharded, "shards")
    assert shards["sharded"] and not whole["sharded"]
    assert any("shard by shard" in note for note in shards["notes"])
    assert shards["layers"] == whole["layers"] == 8 * 7  # every body Linear; the tied head kept
    assert shards["logits"] == whole["logits"]  # the same values quantized the same way
    # the ordinary way holds the fp32 model at once (the measurement tells them apart); shard by
    # shard peaks near half of it: ~130 MB of int8 layers and one layer in bf16 and in fp32 (~190 MB)
    assert whole["peak_mb"] >= 0.9 * FP32_MB, whole["peak_mb"]
    assert shards["peak_mb"] <= 0.6 * FP32_MB, shards["peak_mb"]


def test_a_checkpoint_whose_names_differ_loads_whole_and_says_why(sharded, tmp_path, caplog):
    from safetensors.torch import load_file, save_file

    renamed = tmp_path / "renamed"
    renamed.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (renamed / name).write_bytes((sharded / name).read_bytes())
    tensors = {}
    for file in quantized_load.shard_files(sharded):
        tensors.update(load_file(file))
    tensors["model.norm.scale"] = tensors.pop("model.norm.weight")  # a name this model does not have
    save_file(tensors, renamed / quantized_load.SINGLE_FILE)

    plan = load_plan("int8-weight")
    spec = ModelSpec(name="renamed", task="text-generation", source=str(renamed))
    from accelab.plan.techniques.quantization import choose, make_config

    with caplog.at_level(logging.INFO, logger="accelab.plan.quantized_load"):
        config = make_config(plan.quantization, torch.device("cpu"))
        got = quantized_load.load_quantized(spec, dtype=torch.float32, choose=lambda m: choose(m, plan), config=config)
    assert got is None
    assert "names differ from the model's" in caplog.text and "model.norm" in caplog.text


@pytest.mark.parametrize(
    ("plan", "spec", "reason"),
    [
        ("baseline", {}, "quantizes nothing"),
        ("int8-weight[placement=cpu-offload]", {}, "held on the CPU"),
        ("int8-weight", {"gguf_file": "model.gguf"}, "not a transformers checkpoint"),
        ("int8-weight", {"source": "/nonexistent"}, "no safetensors checkpoint"),
    ],
)
def test_why_a_plan_loads_the_ordinary_way(plan, spec, reason):
    fields = {"name": "m", "task": "text-generation", "source": str(model_dir("smollm2-135m")), **spec}
    why = quantized_load.why_not(ModelSpec(**fields), load_plan(plan), torch.device("cpu"))
    assert why is not None and reason in why, why


def test_the_catalog_llm_under_an_int8_plan_loads_shard_by_shard():
    spec = ModelSpec(name="smollm2-135m", task="text-generation", source=str(model_dir("smollm2-135m")))
    for plan in ("int8-weight", "int8-bf16", "int8-weight[compile=default;quantize_head=true]"):
        assert quantized_load.why_not(spec, load_plan(plan), torch.device("cpu")) is None, plan


def test_the_weights_are_counted_at_the_plans_precision_before_loading(sharded):
    spec = ModelSpec(name="m", task="text-generation", source=str(sharded))
    params = 127_000_000  # about: the exact count below, from the weights themselves
    counted = {plan: fit.weight_bytes(spec, load_plan(plan)) for plan in ("baseline", "bf16", "int8-weight")}
    exact = sum(t.numel() for t in _checkpoint(sharded).values())
    assert abs(exact - params) < 0.02 * params
    assert counted["baseline"] == 4 * exact and counted["bf16"] == 2 * exact  # the tied head once
    # int8: a byte a body weight and a float32 scale a row; the embedding (and the tied head) float32
    embedding = SHAPE["vocab_size"] * SHAPE["hidden_size"]
    assert counted["int8-weight"] == pytest.approx((exact - embedding) + 4 * embedding, rel=0.01)


def _checkpoint(source) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for file in quantized_load.shard_files(source):
        tensors.update(load_file(file))
    return tensors


def test_the_server_refuses_a_plan_that_cannot_fit_before_listening_with_the_figures(sharded):
    # 1400 MiB "available": fp32 needs its 0.5 GB, one sequence's KV cache (0.13 GB) and ~1.1 GB of
    # overhead; int8 (0.14 GB of weights) would fit
    env = {**os.environ, fit.AVAILABLE_ENV: "1400MiB"}
    args = [sys.executable, "-m", "accelab", "serve", str(sharded), "--port", "0", "--plan"]
    refused = subprocess.run([*args, "baseline"], capture_output=True, text=True, timeout=300, env=env, check=False)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "does not fit this machine's memory: weights 0.5 GB (float32) + KV pool 0.1 GB" in refused.stderr
    assert "listening on" not in refused.stderr
    spec = ModelSpec(name="m", task="text-generation", source=str(sharded))
    assert fit.footprint(spec, load_plan("int8-weight"), kv_bytes=134_217_728).fits


def test_the_kv_cache_is_sized_within_the_memory_the_weights_leave(tiny_llm):
    from serving import ServerProcess

    # 1060 MiB "available": the weights (~25 MB), a sequence's KV cache and ~1 GiB of overhead fit;
    # 64 sequences would ask 131,072 tokens (64 MiB), and half the 36 MiB past the 1 GiB headroom hold fewer
    # (an eager plan's steps take the int8 weights over as they pack them: no second copy to count out)
    per_token = 2 * 2 * 2 * 16 * 4  # layers x (keys, values) x KV heads x head size x float32
    room = ((1060 << 20) - (1 << 30)) // 2
    env = {fit.AVAILABLE_ENV: "1060MiB", "OMP_NUM_THREADS": "1"}
    server = ServerProcess(
        "-m", "accelab", "serve", str(tiny_llm), "--plan", "int8-weight", "--max-batch-size", "64", "--port", "0",
        timeout_s=300, env=env,
    )  # fmt: skip
    try:
        server.wait_ready(300)
        kv = httpx.get(f"{server.url}/readyz").json()["kv_cache"]
        assert kv["tokens"] == -(-(room // per_token) // 16) * 16 < 64 * 2048  # whole blocks of 16
        assert kv["bytes"] == kv["tokens"] * per_token
        log = "".join(server.log)
        assert "sized by what the memory left after the weights holds (of 131072 asked)" in log, log[-3000:]
        metrics = httpx.get(f"{server.url}/metrics").text.splitlines()
        free = [line for line in metrics if line.startswith("accelab_kv_cache_bytes{") and 'state="free"' in line]
        assert len(free) == 1 and float(free[0].split()[-1]) == kv["bytes"], free
        answer = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": str(tiny_llm), "prompt": "Hello", "max_tokens": 3, "temperature": 0},
            timeout=120,
        )
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3, answer.text
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    from tiny_models import tiny_smollm2

    return tiny_smollm2(tmp_path_factory.mktemp("tiny-smollm2"), model_dir("smollm2-135m"))


def test_the_kv_room_counts_a_second_int8_copy_only_where_the_steps_keep_one(monkeypatch):
    """An eager text plan's steps take the int8 weights over (held once); a compiled plan's graphs
    hold a copy of their own, which the KV room leaves out first."""
    from types import SimpleNamespace

    import transformers as T
    from torchao.quantization import quantize_

    from accelab.plan.techniques.quantization import head_modules, layer_filter, make_config
    from accelab.serve import state

    torch.manual_seed(0)
    config = T.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    model = T.LlamaForCausalLM(config).eval()
    quantize_(model, make_config("int8-weight", torch.device("cpu")), layer_filter("int8-weight", head_modules(model)))
    copy = sum(m.weight.qdata.numel() for m in model.modules() if hasattr(getattr(m, "weight", None), "qdata"))
    per_token = fit.kv_bytes_per_token(model.config, torch.float32)
    monkeypatch.setenv(fit.AVAILABLE_ENV, "2GiB")

    def room(plan: str) -> int:
        runnable = SimpleNamespace(plan=load_plan(plan), model=model, device=torch.device("cpu"))
        return state._kv_room_tokens(SimpleNamespace(runnable=runnable))

    eager, compiled = room("int8-weight"), room("int8-weight[compile=default]")
    assert eager == ((2 << 30) - state.KV_HEADROOM) // 2 // per_token
    assert compiled == ((2 << 30) - state.KV_HEADROOM - copy) // 2 // per_token < eager
