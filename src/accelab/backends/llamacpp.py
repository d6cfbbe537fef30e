"""llama.cpp (llama-cpp-python): GGUF text generation, batched, greedy or sampled.

The batch arrives tokenized by the Hugging Face tokenizer; its ids go to llama.cpp as they are
(the GGUF's vocabulary is the one the tokenizer was built from; `load` checks the sizes agree).
A batch of B prompts decodes as B sequences of one llama.cpp context, one `llama_decode` per
step for all of them (a prompt that several rows repeat is decoded once, its cells shared), so
a "step" means the same as in transformers' generate: every stopping criterion is called once
per step, right after the step's tokens exist, which is what the bench's TokenClock times
(TTFT, TPOT, ITL). End-of-sequence is ignored until min_new_tokens, so min_new_tokens ==
max_new_tokens decodes exactly that many tokens.

`model(input_ids=...)` returns the logits of every position (the quality guard's perplexity).
This module finds, checks and requantises the GGUF and makes the Runnable; the decoding itself
is `llama_engine.LlamaEngine`, which the server's llama.cpp steps share.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig
from transformers.modeling_outputs import CausalLMOutput

from accelab.backends.export import build_atomically, digest, exports_dir
from accelab.backends.llama_engine import LlamaEngine
from accelab.catalog.facts import text_config
from accelab.catalog.load import load_processor
from accelab.catalog.spec import ModelSpec
from accelab.catalog.store import read_meta
from accelab.plan.backend_options import LlamaOptions
from accelab.plan.plan import Plan
from accelab.plan.runtime import Runnable, Unsupported
from accelab.plan.techniques.system import threads_for

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"


# -- finding the GGUF ----------------------------------------------------------------------------
def check_model(spec: ModelSpec) -> Path:
    """The GGUF llama.cpp would run for `spec`; Unsupported when it has none or is no LLM."""
    if spec.task != "text-generation":
        has = "" if spec.gguf_file else " and has no GGUF"
        raise Unsupported(f"llama.cpp runs text-generation models from GGUF files; {spec.name} is {spec.task}{has}")
    return gguf_path(spec)


def gguf_path(spec: ModelSpec) -> Path:
    """The GGUF of `spec`: its `gguf_file`, else the one its accelab.json keeps beside the weights."""
    name = spec.gguf_file or (read_meta(Path(spec.source)) or {}).get("gguf_file")
    if not name:
        raise Unsupported(
            f"llama.cpp runs GGUF files; {spec.name} ({spec.task}) has none: pass a .gguf file as the model, "
            "or a model directory whose accelab.json names one (gguf_file)"
        )
    path = Path(spec.source) / name
    if not path.is_file():
        raise ValueError(f"{spec.name} names the GGUF {path}, which does not exist; re-fetch the model")
    check_gguf(path)
    return path


def check_gguf(path: Path) -> None:
    """ValueError unless the file starts with the GGUF magic bytes."""
    with open(path, "rb") as handle:
        head = handle.read(4)
    if head != GGUF_MAGIC:
        raise ValueError(
            f"{path} is not a GGUF file: it starts with {head!r}, a GGUF starts with {GGUF_MAGIC!r}; "
            "convert the model with llama.cpp's convert_hf_to_gguf.py, or run it with backend=torch"
        )


# -- the Runnable ----------------------------------------------------------------------------------
def load(spec: ModelSpec, plan: Plan, device: torch.device) -> Runnable:
    options = LlamaOptions.parse(plan.option)
    path = check_model(spec)
    gpu_layers = _gpu_layers(device)
    threads = options.threads or threads_for(plan)
    source_name = path.name
    if options.quant != "gguf":
        path = requantized(path, options.quant, threads)

    # 1. the model and its context
    engine = LlamaEngine(path, threads=threads, n_ctx=options.n_ctx, n_batch=options.n_batch, gpu_layers=gpu_layers)
    try:
        processor = load_processor(spec)
        config = _config(spec)
        _check_vocab(engine, config, spec)
    except BaseException:
        engine.close()
        raise

    # 2. the Runnable: generate_fn decodes, model(...) scores
    runnable = Runnable(
        model=LlamaCppModel(engine, config),
        processor=processor,
        device=device,
        task=spec.task,
        generate_fn=engine.generate,
        weight_bytes=path.stat().st_size,
        spec=spec,
        plan=plan,
        notes=[
            f"llama.cpp (llama-cpp-python {engine.version}) on {source_name}"
            + ("" if options.quant == "gguf" else f" requantised to {options.quant}")
            + f", {threads} thread{'s' if threads > 1 else ''}, "
            f"{'all layers on the GPU' if gpu_layers else 'CPU'}",
            "a batch decodes as parallel sequences of one llama.cpp context (one decode call per step)",
        ],
    )
    runnable.exit_stack.callback(engine.close)
    return runnable


_FTYPES = {"q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q4_0-pure": "LLAMA_FTYPE_MOSTLY_Q4_0", "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0"}
GGML_TYPE_Q8_0 = 8  # ggml.h enum ggml_type


def requantized(path: Path, quant: str, threads: int) -> Path:
    """The GGUF requantised by llama.cpp to `quant`, built once and cached in the exports dir."""
    import llama_cpp

    stat = path.stat()
    key = digest(
        {
            "gguf": str(path.resolve()),
            "size": stat.st_size,
            "mtime": stat.st_mtime_ns,
            "quant": quant,
            "llama_cpp": llama_cpp.__version__,
        }
    )
    directory = exports_dir() / f"gguf-{quant}-{key}"
    if (directory / "model.gguf").is_file():
        log.info("reusing %s requantised to %s from %s", path.name, quant, directory)
        return directory / "model.gguf"

    def build(tmp: Path) -> None:
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, _FTYPES[quant])
        params.allow_requantize, params.nthread = True, threads
        if quant.endswith("-pure"):
            params.pure = True
        else:  # the tied embedding is also the output layer: 4 bits there cost the most quality
            params.token_embedding_type = params.output_tensor_type = GGML_TYPE_Q8_0
        quiet = logging.getLogger("llama-cpp-python")  # llama.cpp logs one line per tensor through it
        previous = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            code = llama_cpp.llama_model_quantize(
                str(path).encode(), str(tmp / "model.gguf").encode(), ctypes.byref(params)
            )
        finally:
            quiet.setLevel(previous)
        if code != 0:
            raise RuntimeError(f"llama.cpp could not requantise {path} to {quant} (code {code})")

    log.info("requantising %s to %s into %s", path.name, quant, directory)
    build_atomically(directory, build)
    return directory / "model.gguf"


def _gpu_layers(device: torch.device) -> int:
    import llama_cpp

    if device.type == "cpu":
        return 0
    if not llama_cpp.llama_supports_gpu_offload():
        raise Unsupported(
            f"this llama-cpp-python build has no GPU offload, and the run is on {device}: rebuild it with "
            'CMAKE_ARGS="-DGGML_CUDA=on" pip install llama-cpp-python, or use --device cpu'
        )
    return -1  # every layer


def _config(spec: ModelSpec) -> Any:
    gguf = {"gguf_file": spec.gguf_file} if spec.gguf_file else {}
    return AutoConfig.from_pretrained(spec.source, **gguf)


def _check_vocab(engine: LlamaEngine, config: Any, spec: ModelSpec) -> None:
    size = getattr(text_config(config), "vocab_size", None)
    if size is not None and size != engine.n_vocab:
        raise Unsupported(
            f"the GGUF of {spec.name} has {engine.n_vocab} tokens but its tokenizer config {size}: the batch's "
            "token ids would mean other tokens to llama.cpp"
        )


class LlamaCppModel:
    """`model(input_ids=..., attention_mask=...)` -> CausalLMOutput(logits [B, S, V]), and the
    transformers config the batch builders read (max positions)."""

    def __init__(self, engine: LlamaEngine, config: Any):
        self.engine = engine
        self.config = config

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **_: Any) -> CausalLMOutput:
        return self.forward(input_ids=input_ids, attention_mask=attention_mask)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **_: Any) -> CausalLMOutput:
        return CausalLMOutput(logits=self.engine.score(input_ids, attention_mask))

    def __repr__(self) -> str:
        return f"LlamaCppModel({self.engine.llm.model_path if self.engine.llm else 'closed'})"
