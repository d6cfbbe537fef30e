"""Tiny vision-language models: real architectures (Idefics3 / SmolVLM, LLaVA) with random
seeded weights, and processors that take real images and text.

Both reuse the SmolLM2 tokenizer (from the fetched `smollm2-135m`) with the image tokens added,
and a ChatML chat template whose image parts become the processor's image placeholder. The
number of image tokens the processor inserts matches what the vision tower produces:
    smolvlm-tiny: (128 / 16)^2 = 64 patches, pixel-shuffled by scale_factor 2 -> 16 tokens
    smolvlm-256m: (512 / 16)^2 = 1024 patches, pixel-shuffled by scale_factor 4 -> 64 tokens
      (SmolVLM-256M's sizes, around the catalog's real SmolLM2-135M weights)
    llava-tiny:   (128 / 16)^2 = 64 patches (+ CLS, dropped by the "default" strategy) -> 64 tokens
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from accelab.catalog.build_vision import image_processor_class, save_seeded
from accelab.paths import model_dir

Step = Callable[[str], None]

TOKENIZER_FROM = "smollm2-135m"
IMAGE_SIZE, PATCH = 128, 16
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A small Llama decoder: 4 layers, hidden 256; most parameters are the 49k-token embedding.
TEXT_CONFIG = dict(
    model_type="llama",
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)
VISION_SIZES = dict(
    hidden_size=192,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    image_size=IMAGE_SIZE,
    patch_size=PATCH,
)


def _smollm2_tokenizer(step: Step, special_tokens: list[str]):
    from transformers import AutoTokenizer

    source = model_dir(TOKENIZER_FROM)
    step(f"loading the SmolLM2 tokenizer from {source} and adding {len(special_tokens)} image tokens")
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.add_special_tokens({"additional_special_tokens": special_tokens})
    return tokenizer


def _text_config(tokenizer) -> dict:
    ids = dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    return dict(TEXT_CONFIG, vocab_size=len(tokenizer), **ids)


def _with_generation_config(model, tokenizer):
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


def build_smolvlm_tiny(target: Path, step: Step) -> None:
    """Idefics3 (the SmolVLM architecture): SigLIP-style vision tower, pixel-shuffle connector,
    Llama decoder. No image splitting, so each image is 16 tokens whatever its aspect."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor

    grid = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    tokenizer = _smollm2_tokenizer(
        step, ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>", *grid]
    )
    scale_factor = 2
    image_processor = image_processor_class("Idefics3ImageProcessor")(
        size={"longest_edge": IMAGE_SIZE}, max_image_size={"longest_edge": IMAGE_SIZE}, do_image_splitting=False
    )
    image_seq_len = (IMAGE_SIZE // PATCH) ** 2 // scale_factor**2
    processor = Idefics3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_len=image_seq_len, chat_template=CHAT_TEMPLATE
    )
    config = Idefics3Config(
        vision_config=VISION_SIZES,
        text_config=_text_config(tokenizer),
        scale_factor=scale_factor,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=True,
    )

    def make() -> Any:
        return _with_generation_config(Idefics3ForConditionalGeneration(config), tokenizer)

    save_seeded(target, step, make, processor)


# SmolVLM-256M's vision tower (SigLIP base, 512 px, patch 16) and connector (pixel shuffle by 4)
SMOLVLM_VISION = dict(
    hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, image_size=512, patch_size=16
)
SMOLVLM_SCALE = 4  # (512 / 16)^2 = 1024 patches -> 64 image tokens


def build_smolvlm_256m(target: Path, step: Step, *, vision: dict | None = None) -> None:
    """SmolVLM-256M's architecture at its real size: the catalog's SmolLM2-135M with its real
    weights as the language model (SmolVLM-256M's is SmolLM2-135M too), a vision tower and
    connector of SmolVLM-256M's shape with random weights (seed 0). Each image is resized to 512
    px and not split into tiles (64 image tokens); the embeddings of the added image tokens are
    the mean of SmolLM2's. `vision` replaces SMOLVLM_VISION (tests build it small)."""
    import torch
    from transformers import AutoModelForCausalLM, Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor

    grid = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    tokenizer = _smollm2_tokenizer(
        step, ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>", *grid]
    )
    vision = vision or SMOLVLM_VISION
    size = vision["image_size"]
    image_processor = image_processor_class("Idefics3ImageProcessor")(
        size={"longest_edge": size}, max_image_size={"longest_edge": size}, do_image_splitting=False
    )
    seq_len = (size // vision["patch_size"]) ** 2 // SMOLVLM_SCALE**2
    processor = Idefics3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_len=seq_len, chat_template=CHAT_TEMPLATE
    )
    step(f"loading SmolLM2-135M's weights from {model_dir(TOKENIZER_FROM)}")
    language: Any = AutoModelForCausalLM.from_pretrained(model_dir(TOKENIZER_FROM), dtype=torch.float32)
    known = language.get_input_embeddings().weight.shape[0]
    language.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    with torch.no_grad():  # the added tokens start at the mean embedding (no random draw: same on every machine)
        embeddings = language.get_input_embeddings().weight
        embeddings[known:] = embeddings[:known].mean(dim=0)
    text = {**language.config.to_dict(), "vocab_size": len(tokenizer)}
    extra: dict[str, Any] = {"pad_token_id": tokenizer.pad_token_id}  # not Idefics3's default 128002
    config = Idefics3Config(
        vision_config=vision,
        text_config=text,
        scale_factor=SMOLVLM_SCALE,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=True,
        **extra,
    )

    def make() -> Any:
        model = Idefics3ForConditionalGeneration(config)
        model.model.text_model.load_state_dict(language.model.state_dict())
        model.tie_weights()
        return _with_generation_config(model.eval(), tokenizer)

    save_seeded(target, step, make, processor)


def build_llava_tiny(target: Path, step: Step) -> None:
    """LLaVA: CLIP vision tower, MLP projector, Llama decoder; 64 image tokens per image."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    tokenizer = _smollm2_tokenizer(step, ["<image>"])
    image_processor = image_processor_class("CLIPImageProcessor")(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH,
        image_token="<image>",
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )
    config = LlavaConfig(
        vision_config=dict(VISION_SIZES, model_type="clip_vision_model", projection_dim=VISION_SIZES["hidden_size"]),
        text_config=_text_config(tokenizer),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        tie_word_embeddings=True,
    )

    def make() -> Any:
        return _with_generation_config(LlavaForConditionalGeneration(config), tokenizer)

    save_seeded(target, step, make, processor)
