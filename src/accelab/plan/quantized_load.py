"""Loading that fits a weight-quantized plan: the model's skeleton without weights, then its
checkpoint one shard at a time, each shard's Linear layers quantized before the next is read, so
the full-precision model never exists in memory (an 8B's fp32 is 29.6 GB, its int8 layers 7.4 GB).

transformers' own route (`from_pretrained(quantization_config=TorchAoConfig(...))`) quantizes as
it loads too, but its loader reads the shards ahead of the quantizer: on a 740M-parameter Llama
it peaked at the whole fp32 model's size (3.1 GB over the process's start), where this loader
peaks at the quantized model plus one shard.

The result is the model `from_pretrained(dtype=...)` followed by torchao's `quantize_` gives (the
same layers quantized from the same values), on the path where that is certain: a torch plan on
the CPU, a transformers model whose safetensors checkpoint names exactly its parameters (a head
tied to the embeddings may be absent). Anything else (a checkpoint of renamed keys, a GGUF file,
a custom module, remote code, a device map) loads the ordinary way, and `why_not` says why.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from accelab.catalog.facts import MODEL_CLASSES
from accelab.catalog.spec import ModelSpec
from accelab.plan.plan import Plan

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True, slots=True)
class ShardLoaded:
    """What `load_quantized` did: the model, the layers it quantized, the shards it read."""

    model: Any
    quantized: list[str]
    shards: int


def shard_files(source: str | Path) -> list[Path] | None:
    """The checkpoint's safetensors files in their index's order, or None where it has none."""
    root = Path(source)
    index = root / INDEX_FILE
    if index.is_file():
        names = dict.fromkeys(json.loads(index.read_text())["weight_map"].values())
        return [root / name for name in names]
    single = root / SINGLE_FILE
    return [single] if single.is_file() else None


def held_on_cpu(plan: Plan, device: torch.device) -> bool:
    """A torch plan whose weights this process holds in CPU memory (no device map, no offload)."""
    return plan.backend == "torch" and device.type == "cpu" and plan.placement in ("auto", "cpu")


def why_not(spec: ModelSpec, plan: Plan, device: torch.device) -> str | None:
    """Why this plan's model loads the ordinary way (full precision, then quantized), or None."""
    if plan.quantization == "none":
        return "the plan quantizes nothing"
    if not held_on_cpu(plan, device):
        return "shard-by-shard loading is for torch plans held on the CPU"
    if spec.custom or spec.gguf_file or spec.trust_remote_code:
        return "the model is not a transformers checkpoint of safetensors shards"
    if spec.task not in MODEL_CLASSES or shard_files(spec.source) is None:
        return "the model has no safetensors checkpoint"
    return None


def load_quantized(
    spec: ModelSpec,
    *,
    dtype: torch.dtype,
    choose: Callable[[torch.nn.Module], Callable[[torch.nn.Module, str], bool]],
    config: Any,
    attn_implementation: str | None = None,
) -> ShardLoaded | None:
    """`spec`'s model in `dtype`, its Linear layers that `choose(model)(module, name)` picks
    quantized with the torchao `config` shard by shard; None (nothing loaded) where the checkpoint's names
    are not exactly the model's parameters: the caller then loads the ordinary way."""
    from accelerate.utils import set_module_tensor_to_device

    files = shard_files(spec.source)
    assert files is not None, "why_not() first"
    model = skeleton(spec, dtype, attn_implementation)
    if not _names_match(spec, model, files):
        return None
    chosen, done = choose(model), set[str]()
    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                set_module_tensor_to_device(model, key, "cpu", value=f.get_tensor(key), dtype=dtype)
        _quantize_ready(model, chosen, config, done)
        trim_heap()
    # a head tied to the embedding still holds the skeleton's empty weight: tied again, it takes
    # the loaded one, and is quantized now where the plan quantizes the head (it is then untied,
    # as quantize_ after from_pretrained unties it)
    model.tie_weights()
    _quantize_ready(model, chosen, config, done)
    left = [name for name, p in model.named_parameters() if p.is_meta]
    if left:
        raise RuntimeError(f"{spec.name}: its checkpoint left these weights unloaded: {left[:5]}")
    _finish(model, spec)
    return ShardLoaded(model=model.eval(), quantized=sorted(done), shards=len(files))


def _names_match(spec: ModelSpec, model: Any, files: list[Path]) -> bool:
    """Whether the checkpoint names exactly the model's parameters (a tied head may be absent)."""
    keys: set[str] = set()
    for file in files:
        with safe_open(file, framework="pt") as f:
            keys.update(f.keys())
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = params.keys() - keys - _tied(model)
    unknown = keys - params.keys() - dict(model.named_buffers()).keys()
    if missing or unknown:
        log.info(
            "%s: its checkpoint's names differ from the model's (%d missing, %d unknown, e.g. %s); loading it whole",
            spec.name,
            len(missing),
            len(unknown),
            sorted(missing | unknown)[:3],
        )
    return not (missing or unknown)


def _quantize_ready(model: Any, chosen: Callable[[torch.nn.Module, str], bool], config: Any, done: set[str]) -> None:
    """Quantize the chosen Linear layers whose weights are all in and that are not quantized yet."""
    from torchao.quantization import quantize_

    picked = {
        name
        for name, module in model.named_modules()
        if name not in done and chosen(module, name) and not any(p.is_meta for p in module.parameters(recurse=False))
    }
    if picked:
        quantize_(model, config, filter_fn=lambda module, name: name in picked)
        done.update(picked)


def skeleton(spec: ModelSpec, dtype: torch.dtype, attn_implementation: str | None = None) -> Any:
    """`spec`'s transformers model with its parameters on the meta device (allocated empty, never
    initialised: an 8B's random init would take minutes) and its buffers computed as its __init__
    computes them (rotary frequencies): the shapes and module names, in no memory."""
    import transformers
    from accelerate import init_empty_weights
    from transformers.initialization import no_init_weights

    config = transformers.AutoConfig.from_pretrained(spec.source)
    model_class = getattr(transformers, MODEL_CLASSES[spec.task])
    options = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with no_init_weights(), init_empty_weights(include_buffers=False):
        model = model_class.from_config(config, dtype=dtype, **options)
    model.tie_weights()  # what the skipped init would have done: a tied head is the embedding
    return model


def trim_heap() -> None:
    """Return freed weights (a shard's full-precision ones, a model's handed over) to the system.
    glibc keeps freed blocks under its mmap threshold (up to 32 MiB: every weight of a small model)
    in its heaps, interleaved with the int8 weights allocated since: on a 74M-parameter Llama the
    process grew by the fp32 model's size anyway (558 MB), 155 MB after a trim. Elsewhere than glibc
    nothing is called."""
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


def _tied(model: Any) -> set[str]:
    """The parameter names a tied checkpoint may leave out (transformers ties them after loading)."""
    tied = getattr(model, "_tied_weights_keys", None) or {}
    names = tied.keys() if isinstance(tied, dict) else tied
    if not getattr(model.config, "tie_word_embeddings", False):
        return set()
    return set(names)


def _finish(model: Any, spec: ModelSpec) -> None:
    """What from_pretrained also sets: the source's name and its generation config."""
    model.config._name_or_path = str(spec.source)
    has_config = (Path(spec.source) / "generation_config.json").is_file()
    if getattr(model, "generation_config", None) is not None and has_config:
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(spec.source)
