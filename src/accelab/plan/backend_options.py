"""Backend options: the `backend_options` pairs of a Plan, parsed and validated per backend.

A Plan carries them as strings (`(("ort_fusion", "on"), ("ort_quant", "int8-dynamic"))`) so it
stays YAML-friendly; each backend reads them through one frozen dataclass here, which rejects
unknown keys and values with the allowed set. Pure logic: no runtime is imported.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

OnOff = Literal["on", "off"]
OrtOptLevel = Literal["0", "1", "2", "99"]  # disabled, basic, extended, all (ORT's GraphOptimizationLevel)
OrtQuant = Literal["none", "int8-dynamic"]
OrtProvider = Literal["auto", "cpu", "cuda"]
OrtQuantOps = Literal["all", "matmul", "attention"]  # which ops int8 dynamic quantisation converts
OvPrecision = Literal["f32", "bf16"]
OvHint = Literal["LATENCY", "THROUGHPUT"]
# the weights OpenVINO GenAI generates with: as exported, or compressed by NNCF (optimum-intel's
# exporter, --weight-format); int4 is asymmetric with a group of 64 (SmolLM2's 576 is no multiple of 128)
OvWeights = Literal["fp32", "int8", "int4"]
# the KV cache's precision; same: the inference precision (OpenVINO's own CPU default is u8, a
# quantisation the plan would not have asked for)
OvKvPrecision = Literal["same", "u8", "bf16", "f32"]
# gguf: the file as it is; q4_0 / q8_0: requantised by llama.cpp (q4_0 has AVX2/AVX512 repacked
# kernels); "-pure" also requantises the token embedding (tied to the output layer), else Q8_0
LlamaQuant = Literal["gguf", "q4_0", "q4_0-pure", "q8_0"]
VllmDtype = Literal["float32", "bfloat16", "float16"]
VllmMode = Literal["eager", "compiled"]  # enforce_eager, or vLLM's torch.compile + graph capture
VllmBlockSize = Literal["16", "32", "64", "128", "256"]  # tokens per KV block (vLLM CPU prefers multiples of 32)

# option key -> (backend, Literal of allowed values or int); the one table the CLI help, the
# validation and the README draw from
OPTION_KEYS: dict[str, tuple[str, object]] = {
    "ort_fusion": ("onnxruntime", OnOff),
    "ort_opt_level": ("onnxruntime", OrtOptLevel),
    "ort_quant": ("onnxruntime", OrtQuant),
    "ort_per_channel": ("onnxruntime", OnOff),
    "ort_reduce_range": ("onnxruntime", OnOff),
    "ort_quant_ops": ("onnxruntime", OrtQuantOps),
    "ort_provider": ("onnxruntime", OrtProvider),
    "ov_precision": ("openvino", OvPrecision),
    "ov_hint": ("openvino", OvHint),
    "ov_weights": ("openvino", OvWeights),
    "ov_kv_precision": ("openvino", OvKvPrecision),
    "ov_max_num_seqs": ("openvino", int),
    "ov_max_num_batched_tokens": ("openvino", int),
    "ov_kv_cache_gib": ("openvino", int),
    "ov_prefix_caching": ("openvino", OnOff),
    "llama_threads": ("llamacpp", int),
    "n_ctx": ("llamacpp", int),
    "n_batch": ("llamacpp", int),
    "llama_quant": ("llamacpp", LlamaQuant),
    "vllm_dtype": ("vllm", VllmDtype),
    "vllm_mode": ("vllm", VllmMode),
    "vllm_max_num_seqs": ("vllm", int),
    "vllm_max_num_batched_tokens": ("vllm", int),
    "vllm_block_size": ("vllm", VllmBlockSize),
    "vllm_prefix_caching": ("vllm", OnOff),
    "vllm_kv_cache_gib": ("vllm", int),
    "vllm_max_model_len": ("vllm", int),
}


def check_options(backend: str, options: dict[str, str]) -> None:
    """Every key belongs to `backend` and every value is allowed (and the combination, for the
    backends whose options depend on each other); ValueError names the culprit."""
    _check(backend, options)
    parsers: dict[str, Callable[[dict[str, str]], object]] = {
        "onnxruntime": OrtOptions.parse,
        "openvino": OvOptions.parse,
        "llamacpp": LlamaOptions.parse,
        "vllm": VllmOptions.parse,
    }
    if backend in parsers:
        parsers[backend](options)


def _check(backend: str, options: dict[str, str]) -> None:
    own = [k for k, (b, _) in OPTION_KEYS.items() if b == backend]
    for key, value in options.items():
        if key in OPTION_KEYS and key not in own:
            other = OPTION_KEYS[key][0]
            raise ValueError(
                f"backend option {key}={value!r} is an option of backend={other}, and this plan runs "
                f"backend={backend}; add backend={other} (--set backend={other})"
            )
        if key not in own:
            close = difflib.get_close_matches(key, own, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"backend option {key}={value!r} is not an option of backend={backend}{hint}; "
                f"its options are: {', '.join(own) or 'none'}"
            )
        kind = OPTION_KEYS[key][1]
        if kind is int:
            if not value.isdecimal() or int(value) < 1:
                raise ValueError(f"backend option {key}={value!r} must be a whole number of 1 or more")
        elif value not in get_args(kind):
            raise ValueError(
                f"backend option {key}={value!r} is not allowed; choose one of: {', '.join(get_args(kind))}"
            )


def _checked(options: dict[str, str], prefix: str) -> dict[str, Any]:
    """Options `_check` passed, by field name: each value is one its field's Literal allows."""
    return {key.removeprefix(prefix): value for key, value in options.items()}


@dataclass(frozen=True, kw_only=True, slots=True)
class OrtOptions:
    fusion: OnOff = "off"  # ORT's transformer optimizer (fused attention, LayerNorm, GELU)
    opt_level: OrtOptLevel = "99"
    quant: OrtQuant = "none"
    per_channel: OnOff = "on"  # int8 scales per output channel: min cosine 0.988 vs 0.933 per tensor on MiniLM
    reduce_range: OnOff = "on"  # 7-bit weights: no int16 saturation in VPMADDUBSW on CPUs without VNNI
    # all: every MatMul and fused Attention; matmul: the projections and the MLP outside fused
    # attention; attention: only the fused Attention's QKV projection (min cosine on MiniLM,
    # 64 sentences, per channel: all 0.987-0.989, matmul 0.991-0.993, attention 0.998)
    quant_ops: OrtQuantOps = "all"
    provider: OrtProvider = "auto"

    def __post_init__(self) -> None:
        if self.quant != "none" and self.quant_ops == "attention" and self.fusion != "on":
            raise ValueError(
                "backend option ort_quant_ops='attention' quantises the fused Attention ops, which only "
                "ort_fusion='on' makes; add ort_fusion=on or choose ort_quant_ops all|matmul"
            )

    @classmethod
    def parse(cls, options: dict[str, str]) -> OrtOptions:
        _check("onnxruntime", options)
        return cls(**_checked(options, "ort_"))

    def describe(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))


@dataclass(frozen=True, kw_only=True, slots=True)
class OvOptions:
    # f32 by default: OpenVINO itself would pick bf16 on CPUs with AVX512-BF16 or AMX, which is a
    # precision change the plan did not ask for
    precision: OvPrecision = "f32"
    hint: OvHint = "LATENCY"  # forward passes (the graph backend); generation schedules its own steps
    # text generation (OpenVINO GenAI's ContinuousBatchingPipeline, accelab.backends.openvino_genai):
    weights: OvWeights = "fp32"
    kv_precision: OvKvPrecision = "same"
    max_num_seqs: int | None = None  # sequences scheduled at once (serve: --max-batch-size when unset)
    max_num_batched_tokens: int | None = None  # tokens per step (prefill chunks + decodes); None: 256
    kv_cache_gib: int = 1  # the KV-cache pool, allocated at start (its blocks are the capacity /metrics shows)
    # off by default, as for vLLM: a bench repeats one batch, and a prefix cache would skip its prefills
    prefix_caching: OnOff = "off"

    @classmethod
    def parse(cls, options: dict[str, str]) -> OvOptions:
        _check("openvino", options)
        values: dict[str, Any] = {}
        for key, value in options.items():
            values[key.removeprefix("ov_")] = int(value) if OPTION_KEYS[key][1] is int else value
        return cls(**values)

    @property
    def kv_cache_precision(self) -> str:
        return self.precision if self.kv_precision == "same" else self.kv_precision

    def generation_only(self) -> list[str]:
        """The options set here that only text generation reads (a forward-pass plan refuses them)."""
        base = OvOptions()
        names = ("weights", "kv_precision", "max_num_seqs", "max_num_batched_tokens", "kv_cache_gib", "prefix_caching")
        return [f"ov_{n}={getattr(self, n)}" for n in names if getattr(self, n) != getattr(base, n)]


@dataclass(frozen=True, kw_only=True, slots=True)
class LlamaOptions:
    threads: int | None = None  # None: the plan's threads, else every CPU this process may use
    n_ctx: int = 2048
    n_batch: int = 512
    quant: LlamaQuant = "gguf"

    @classmethod
    def parse(cls, options: dict[str, str]) -> LlamaOptions:
        _check("llamacpp", options)
        values: dict[str, Any] = {}  # each one _check allows
        for key, value in options.items():
            if key == "llama_quant":
                values["quant"] = value
            else:
                values["threads" if key == "llama_threads" else key] = int(value)
        return cls(**values)


@dataclass(frozen=True, kw_only=True, slots=True)
class VllmOptions:
    """vLLM's engine arguments a plan sets (`vllm_<field>`); None: vLLM's own default."""

    dtype: VllmDtype = "float32"  # the baseline's precision; vLLM's "auto" would follow the checkpoint
    # eager by default: ready in about half the time (52 s against 98 s here), and compiled's decode
    # gain did not stand out of the noise of this shared machine (docs/runtimes.md, vLLM as a runtime); tune tries both
    mode: VllmMode = "eager"
    max_num_seqs: int | None = None  # sequences scheduled at once (serve: --max-batch-size when unset)
    max_num_batched_tokens: int | None = None  # tokens per engine step (prefill chunks + decodes)
    block_size: int | None = None  # KV-cache block, tokens
    # off by default: a bench repeats one batch, and a prefix cache would skip every prefill after
    # the first call (TTFT of nothing); on is what a chat server with shared system prompts wants
    prefix_caching: OnOff = "off"
    kv_cache_gib: int | None = None  # KV-cache size (CPU: VLLM_CPU_KVCACHE_SPACE, GiB); None: 2 GiB on CPU
    max_model_len: int | None = None  # longest prompt + output; None: the model's context

    def __post_init__(self) -> None:
        if self.max_num_seqs and self.max_num_batched_tokens and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"backend option vllm_max_num_batched_tokens={self.max_num_batched_tokens} is below "
                f"vllm_max_num_seqs={self.max_num_seqs}: every running sequence needs a token per step; "
                f"raise it to {self.max_num_seqs} or more"
            )

    @classmethod
    def parse(cls, options: dict[str, str]) -> VllmOptions:
        _check("vllm", options)
        values: dict[str, Any] = {}  # each one _check allows
        for key, value in options.items():
            name = key.removeprefix("vllm_")
            values[name] = int(value) if OPTION_KEYS[key][1] is int or name == "block_size" else value
        return cls(**values)

    def describe(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self) if getattr(self, f.name) is not None)
