"""Image classifiers at their real sizes with random (seeded) weights, built from config.

Speed does not depend on the weights, so these stand in for the Hub checkpoints offline.
transformers' own classes are used (timm / torchvision do not import beside torch 2.13 CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel

Step = Callable[[str], None]

SEED = 0
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]
BICUBIC, BILINEAR = 3, 2  # PIL resample codes, as the Hub processor configs store them


def save_seeded(target: Path, step: Step, make_model: Callable[[], PreTrainedModel], processor: Any) -> None:
    """Build the model under a fixed seed (same weights on every machine with the same torch)
    without touching the caller's RNG state, then save it and its processor."""
    import torch

    step("building the model from its config with seed 0")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = make_model()
    n_params = sum(p.numel() for p in model.parameters())
    step(f"saving {n_params / 1e6:.1f}M fp32 parameters and the processor")
    model.save_pretrained(target)
    processor.save_pretrained(target)


def image_processor_class(base: str) -> type:
    """The PIL flavour of an image processor (transformers >= 5.2x names it `<base>Pil`; without
    torchvision the base name falls back to it with a warning), else the base class."""
    import transformers

    return getattr(transformers, f"{base}Pil", None) or getattr(transformers, base)


def _imagenet_convnet_processor():
    # microsoft/resnet-50 and facebook/convnext-tiny-224 both ship this preprocessor config:
    # resize the short side to 224 / 0.875 = 256, centre-crop 224, ImageNet mean/std.
    return image_processor_class("ConvNextImageProcessor")(
        size={"shortest_edge": 224},
        crop_pct=0.875,
        resample=BICUBIC,
        image_mean=IMAGENET_MEAN,
        image_std=IMAGENET_STD,
    )


def _vit_processor(size: int):
    return image_processor_class("ViTImageProcessor")(
        size={"height": size, "width": size}, resample=BILINEAR, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )


def build_vit_base(target: Path, step: Step) -> None:
    """google/vit-base-patch16-224: 12 layers, hidden 768, patch 16, 224 px, 1000 labels."""
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
        image_size=224,
        patch_size=16,
    )
    config.num_labels = 1000  # a property of the config, not an argument of its dataclass
    save_seeded(target, step, lambda: ViTForImageClassification(config), _vit_processor(224))


def build_resnet50(target: Path, step: Step) -> None:
    """microsoft/resnet-50: bottleneck blocks [3, 4, 6, 3], widths 256..2048, 1000 labels."""
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(
        embedding_size=64,
        hidden_sizes=[256, 512, 1024, 2048],
        depths=[3, 4, 6, 3],
        layer_type="bottleneck",
        hidden_act="relu",
        downsample_in_first_stage=False,
    )
    config.num_labels = 1000
    save_seeded(target, step, lambda: ResNetForImageClassification(config), _imagenet_convnet_processor())


def build_convnext_tiny(target: Path, step: Step) -> None:
    """facebook/convnext-tiny-224: depths [3, 3, 9, 3], widths 96..768, 1000 labels."""
    from transformers import ConvNextConfig, ConvNextForImageClassification

    config = ConvNextConfig(depths=[3, 3, 9, 3], hidden_sizes=[96, 192, 384, 768])
    config.num_labels = 1000
    save_seeded(target, step, lambda: ConvNextForImageClassification(config), _imagenet_convnet_processor())


def build_vit_tiny(target: Path, step: Step) -> None:
    """A ViT small enough to train on 8x8 digits upscaled to 32 px in minutes on a CPU
    (4 layers, hidden 192, patch 4 -> 64 patches, 10 labels "0".."9")."""
    from transformers import ViTConfig, ViTForImageClassification

    labels = {i: str(i) for i in range(10)}
    config = ViTConfig(
        hidden_size=192,
        num_hidden_layers=4,
        num_attention_heads=3,
        intermediate_size=768,
        image_size=32,
        patch_size=4,
        id2label=labels,
        label2id={v: k for k, v in labels.items()},
    )
    save_seeded(target, step, lambda: ViTForImageClassification(config), _vit_processor(32))
