"""Small stand-ins for the catalog's models, built in seconds, for tests whose subject is a path
(a plan's start-up, an export, a cache), not a model's size: the paths are the same at any size."""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def tiny_smollm2(out: Path, source: Path) -> Path:
    """SmolLM2's architecture at two layers of 64 and an output layer of its own, random weights
    (seed 0), with the tokenizer and chat template of `source` (the fetched SmolLM2)."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(source)
    for name, value in dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ).items():
        setattr(config, name, value)
    config.head_dim = 16
    config.tie_word_embeddings = False  # an output layer of its own: quantize_head quantizes it
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    return out
