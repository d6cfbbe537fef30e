"""Builders of the catalog's real-size LLMs with random weights, written one shard at a time: the
model is laid out on the meta device (names and shapes, nothing allocated), and each shard's
tensors are made, written as bf16 safetensors and dropped before the next, so an 8B model (14.8 GB
in bf16) is built on a machine that could not hold it in fp32 (29.6 GB), at a peak of one shard.

The weights are the same on every machine: each tensor draws from its own generator, seeded by
the catalog's seed and the tensor's name (independent of build order), as integers (torch's
Mersenne Twister: exact on every CPU, where a normal draw goes through vectorised transcendental
math that may differ in its last bits between CPU kinds), scaled to a uniform distribution with
the standard deviation transformers initialises Llama's layers with; the norms are ones.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from accelab.catalog.build_text import generation_config, smollm2_tokenized_llama

Step = Callable[[str], None]

SEED = 0
LAYERS_PER_SHARD = 2  # ~0.9 GB of bf16 a shard at 8B: the build's peak memory
_LEVELS = 1 << 15  # the integer draw's half-range: values are (-1..1) * sqrt(3) * std in steps of 1/32768

# Llama-3.1-8B's architecture and sizes (its config.json on the Hub), with SmolLM2's tokenizer (49152
# tokens, not Llama 3's 128256: all this offline machine has), as llama-1b does: 32 layers of hidden
# 4096, 32 query / 8 KV heads of 128, SiLU MLP of 14336, an output layer of its own, RoPE base 500000
# with Llama 3.1's scaling: 7.38B parameters (6.98B in the layers), 14.8 GB in bf16.
LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    tie_word_embeddings=False,
    hidden_act="silu",
)


def build_llama_8b(target: Path, step: Step, *, sizes: dict[str, Any] | None = None) -> None:
    """Llama-3.1-8B's architecture with random weights (seed 0, the same on every machine) and
    SmolLM2's tokenizer and chat template (from the fetched smollm2-135m), written in bf16 shards
    one at a time. `sizes` replaces LLAMA_8B (tests build it small)."""
    import torch
    from transformers import LlamaForCausalLM

    tokenizer, config = smollm2_tokenized_llama(sizes or LLAMA_8B)
    with torch.device("meta"):  # the names and shapes of its tensors: nothing allocated
        shapes = {name: tuple(t.shape) for name, t in LlamaForCausalLM(config).state_dict().items()}
    count = sum(_numel(s) for s in shapes.values())
    step(
        f"building {config.num_hidden_layers} layers of hidden {config.hidden_size} with seed {SEED}: "
        f"{count / 1e9:.2f}B bf16 parameters ({2 * count / 1e9:.1f} GB), one shard at a time"
    )
    shards = _shards(shapes, config.num_hidden_layers)
    write_random_shards(target, shards, std=config.initializer_range, step=step)
    config.save_pretrained(target)
    generation_config(tokenizer).save_pretrained(target)
    tokenizer.save_pretrained(target)  # keeps the chat template (chat_template.jinja)


def write_random_shards(target: Path, shards: list[dict[str, tuple[int, ...]]], *, std: float, step: Step) -> None:
    """Each shard's tensors (name -> shape) made by `random_tensor`, saved as
    model-0000i-of-0000n.safetensors, with the index that maps every name to its file."""
    from safetensors.torch import save_file

    target.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: random_tensor(name, shape, std) for name, shape in shard.items()}
        save_file(tensors, str(target / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(shard, file))
        del tensors
        step(f"wrote {file} ({total / 1e9:.1f} GB so far)")
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (target / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def random_tensor(name: str, shape: tuple[int, ...], std: float) -> Any:
    """The bf16 tensor `name` of `shape`: ones for a norm's weight, else uniform with standard
    deviation `std` from the generator of (SEED, name) (the module docstring says why integers)."""
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(_seed_of(name))
    draw = torch.randint(-_LEVELS, _LEVELS, shape, generator=generator, dtype=torch.int32)
    scale = std * 3**0.5 / _LEVELS  # uniform on (-a, a) has standard deviation a / sqrt(3)
    return (draw.to(torch.float32) * scale).to(torch.bfloat16)


def _seed_of(name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{SEED}:{name}".encode()).digest()[:8], "little") >> 1


def _shards(shapes: dict[str, tuple[int, ...]], layers: int) -> list[dict[str, tuple[int, ...]]]:
    """The tensors grouped LAYERS_PER_SHARD layers a shard, the embedding with the first and the
    final norm and output layer with the last."""
    groups: list[dict[str, tuple[int, ...]]] = [{} for _ in range(max(1, -(-layers // LAYERS_PER_SHARD)))]
    for name, shape in shapes.items():
        if name.startswith("model.layers."):
            index = int(name.split(".")[2]) // LAYERS_PER_SHARD
        else:
            index = 0 if "embed_tokens" in name else len(groups) - 1
        groups[index][name] = shape
    return groups


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n
