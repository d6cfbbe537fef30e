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
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.modeling_outputs import CausalLMOutput

from accelab.backends.export import build_atomically, digest, exports_dir
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


# -- the engine -------------------------------------------------------------------------------------
@dataclass(slots=True)
class _Context:
    ctx: Any  # llama_context_p
    n_ctx: int
    n_seq: int


class LlamaEngine:
    """A llama.cpp model and one context, grown when a call needs more sequences or positions."""

    def __init__(self, path: Path, *, threads: int, n_ctx: int, n_batch: int, gpu_layers: int):
        import llama_cpp
        from llama_cpp import Llama

        self.version = llama_cpp.__version__
        self.threads, self.n_ctx, self.n_batch = threads, n_ctx, n_batch
        # Llama loads the weights (mmap) and silences llama.cpp's logging; its own context is
        # left minimal: decoding runs on contexts made here, with as many sequences as the batch
        llm = Llama(
            model_path=str(path),
            n_ctx=32,
            n_batch=32,
            n_threads=threads,
            n_threads_batch=threads,
            n_gpu_layers=gpu_layers,
            verbose=False,
        )
        self.llm: Llama | None = llm  # None once closed
        self.n_vocab = llm.n_vocab()
        self.eos = llm.token_eos()
        self._context: _Context | None = None
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        log.info("llama.cpp loaded %s (%d threads)", path, threads)

    def close(self) -> None:
        import llama_cpp

        if self._context is not None:
            llama_cpp.llama_free(self._context.ctx)
            self._context = None
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if self.llm is not None:
            self.llm.close()
            self.llm = None

    @property
    def model(self) -> Any:
        """llama.cpp's model (the weights), which the contexts made here and beside it share."""
        assert self.llm is not None, "the llama.cpp engine is closed"
        return self.llm.model

    # contexts
    def context(self, n_seq: int, n_tokens: int) -> Any:
        """An empty context with room for n_seq sequences and n_tokens positions over all of them."""
        import llama_cpp

        current = self._context
        if current is None or current.n_seq < n_seq or current.n_ctx < n_tokens:
            if current is not None:
                llama_cpp.llama_free(current.ctx)
                self._context = None
            size = max(self.n_ctx, -(-n_tokens // 256) * 256)
            params = llama_cpp.llama_context_default_params()
            params.n_ctx, params.n_seq_max, params.kv_unified = size, max(n_seq, 1), True
            params.n_batch = params.n_ubatch = self.n_batch
            params.n_threads = params.n_threads_batch = self.threads
            params.no_perf = True
            ctx = llama_cpp.llama_init_from_model(self.model, params)
            if not ctx:
                raise RuntimeError(f"llama.cpp could not create a context of {size} positions for {n_seq} sequences")
            self._context = current = _Context(ctx=ctx, n_ctx=size, n_seq=max(n_seq, 1))
            log.info("llama.cpp context: %d positions, %d sequences", size, n_seq)
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(current.ctx), True)
        return current.ctx

    def decode(self, ctx: Any, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) entries (<= n_batch)."""
        decode_entries(ctx, self._batch, entries)

    def logits(self, ctx: Any, index: int) -> np.ndarray:
        """The logits of the index-th output of the last decode: [n_vocab] (a view: copy to keep)."""
        import llama_cpp

        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, index), shape=(self.n_vocab,))

    def prefill(
        self, ctx: Any, prompts: list[list[int]], *, all_logits: bool = False, seqs: list[int] | None = None
    ) -> list[np.ndarray]:
        """Decode every prompt (prompt i as sequence seqs[i], by default i), n_batch tokens per
        call. Returns the last position's logits per prompt, or with all_logits every
        position's ([len, V] each)."""
        seqs = list(range(len(prompts))) if seqs is None else seqs
        entries = [
            (tok, pos, i, all_logits or pos == len(p) - 1) for i, p in enumerate(prompts) for pos, tok in enumerate(p)
        ]
        out: list[list[np.ndarray]] = [[] for _ in prompts]
        for start in range(0, len(entries), self.n_batch):
            chunk = entries[start : start + self.n_batch]
            self.decode(ctx, [(tok, pos, seqs[i], wants) for tok, pos, i, wants in chunk])
            for j, (_, _, i, wants) in enumerate(chunk):
                if wants:
                    out[i].append(self.logits(ctx, j).copy())
        return [np.stack(rows) if all_logits else rows[-1] for rows in out]

    def prefill_shared(self, ctx: Any, prompts: list[list[int]]) -> list[np.ndarray]:
        """The last position's logits of every prompt (prompt i as sequence i), a prompt that
        several rows repeat decoded once, as the sequence of its first row, and its cells shared
        with the others (`llama_memory_seq_cp`: no copy, a cell belongs to several sequences).
        Why: the server's n > 1 choices are rows of one prompt; decoded as copies side by side,
        they would not even get the same logits (ggml's CPU flash attention takes another
        kernel, rounding otherwise, from 64 tokens a decode on) and greedy choices would differ."""
        import llama_cpp

        first: dict[tuple[int, ...], int] = {}  # prompt -> the first row that has it
        for row, p in enumerate(prompts):
            first.setdefault(tuple(p), row)
        rows = list(first.values())
        logits = dict(zip(rows, self.prefill(ctx, [prompts[r] for r in rows], seqs=rows)))
        memory = llama_cpp.llama_get_memory(ctx)
        for row, p in enumerate(prompts):
            if first[tuple(p)] != row:
                llama_cpp.llama_memory_seq_cp(memory, first[tuple(p)], row, 0, len(p))
        return [logits[first[tuple(p)]] for p in prompts]

    # the Runnable's generate_fn
    def generate(
        self,
        batch: dict[str, torch.Tensor],
        max_new_tokens: int,
        min_new_tokens: int | None = None,
        do_sample: bool = False,
        stopping_criteria: Any = None,
        pad_token_id: int | None = None,
        **sampling: Any,
    ) -> torch.Tensor:
        """Decode every row; returns [B, prompt + new] like transformers' generate (finished rows
        are padded). Sampling takes generate's logits_processor, temperature, top_k and top_p."""
        pick = token_picker(do_sample, **sampling)
        ids = batch["input_ids"].cpu()
        mask = batch.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask.cpu()
        prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]  # left padding removed
        lengths = [len(p) for p in prompts]
        b, width = ids.shape
        pad = self.eos if pad_token_id is None else pad_token_id
        out = torch.full((b, width + max_new_tokens), pad, dtype=torch.long)  # [B, prompt + new]
        out[:, :width] = ids
        criteria = list(stopping_criteria or [])
        finished = torch.zeros(b, dtype=torch.bool)

        ctx = self.context(b, sum(lengths) + b * max_new_tokens)
        # prefill: one decode of every distinct prompt; note: TTFT covers it and the first pick
        tokens = pick(np.stack(self.prefill_shared(ctx, prompts)), out[:, :width])  # [B]
        for step in range(max_new_tokens):
            end = width + step + 1
            out[:, end - 1] = torch.where(finished, pad, tokens)
            if step + 1 >= (min_new_tokens or 0):
                finished |= tokens == self.eos
            if _stop(criteria, out[:, :end]) or bool(finished.all()) or end == out.shape[1]:
                return out[:, :end]
            self.decode(ctx, [(int(t), lengths[i] + step, i, True) for i, t in enumerate(tokens)])
            tokens = pick(np.stack([self.logits(ctx, i) for i in range(b)]), out[:, :end])
        return out[:, :width]  # max_new_tokens == 0

    def score(self, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Logits of every position of every row, [B, S, V]; padded positions are zeros."""
        mask = torch.ones_like(ids) if mask is None else mask
        logits = torch.zeros(*ids.shape, self.n_vocab)
        for r, (row, m) in enumerate(zip(ids.cpu(), mask.cpu().bool())):
            tokens = row[m].tolist()
            if tokens:
                ctx = self.context(1, len(tokens))
                logits[r, m] = torch.from_numpy(self.prefill(ctx, [tokens], all_logits=True)[0])
        return logits


def decode_entries(ctx: Any, batch: Any, entries: list[tuple[int, int, int, bool]]) -> None:
    """Fill a llama_batch with (token, position, sequence, wants logits) entries and decode it."""
    import llama_cpp

    batch.n_tokens = len(entries)
    for i, (token, pos, seq, logits) in enumerate(entries):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
        batch.seq_id[i][0] = seq
    code = llama_cpp.llama_decode(ctx, batch)
    if code != 0:
        raise RuntimeError(
            f"llama_decode returned {code} for {len(entries)} tokens"
            + (" (no free KV cells: raise --kv-cache-tokens)" if code == 1 else "")
        )


Picker = Callable[[np.ndarray, torch.Tensor], torch.Tensor]  # (logits [B, V], ids so far [B, S]) -> [B]


def token_picker(
    do_sample: bool,
    logits_processor: Any = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    **_: Any,
) -> Picker:
    """Greedy argmax, or sampling through generate's processors and warpers (the same classes)."""
    if not do_sample:
        return lambda logits, ids: torch.from_numpy(logits.argmax(axis=1)).long()

    steps = list(logits_processor or [])
    if temperature is not None and temperature != 1.0:
        steps.append(TemperatureLogitsWarper(temperature))
    if top_k:
        steps.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        steps.append(TopPLogitsWarper(top_p))

    def sample(logits: np.ndarray, ids: torch.Tensor) -> torch.Tensor:
        scores = torch.from_numpy(logits)  # a copy of llama.cpp's buffer (np.stack): processors may write
        for step in steps:
            scores = step(ids, scores)
        return torch.multinomial(torch.softmax(scores.float(), dim=-1), 1)[:, 0]

    return sample


def _stop(criteria: list[Any], input_ids: torch.Tensor) -> bool:
    """Call every criterion once (each must see every step); stop when one says all rows are done."""
    stop = False
    for criterion in criteria:
        done = criterion(input_ids, None)
        stop |= bool(torch.as_tensor(done).all())
    return stop


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
