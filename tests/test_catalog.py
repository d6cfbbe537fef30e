"""Catalog tests on the real cache (`make test` runs `accelab models fetch --all` first) and real
models: resolution, task inference, loading, sample inputs, batches, generation."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from accelab.catalog.entries import CATALOG
from accelab.catalog.facts import max_sequence_length
from accelab.catalog.inputs import (
    digits,
    embed,
    forward_batch,
    generate_batch,
    heldout_text,
    photos,
    prompts,
    sentences,
)
from accelab.catalog.load import Loaded, load, load_processor
from accelab.catalog.resolve import resolve
from accelab.catalog.taskinfer import infer_task


@functools.cache
def loaded(name: str) -> Loaded:
    return load(resolve(name))


@pytest.fixture(scope="module", autouse=True)
def _free_models():
    yield
    loaded.cache_clear()  # ~1.5 GB of models: do not keep them for the rest of the session


# Resolution and task inference


def test_unknown_name_lists_catalog_and_close_names():
    with pytest.raises(ValueError) as err:
        resolve("smollm-135")
    message = str(err.value)
    assert "Closest: smollm2-135m" in message
    assert all(name in message for name in CATALOG)


def test_missing_path_names_the_path(tmp_path):
    missing = tmp_path / "nowhere" / "model.gguf"
    with pytest.raises(ValueError, match=f"path {missing} does not exist"):
        resolve(str(missing))


def test_bad_task_override_lists_tasks():
    with pytest.raises(ValueError, match="text-generation"):
        resolve("vit-tiny", task="segmentation")


@pytest.mark.parametrize(
    ("config", "task"),
    [
        ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "text-generation"),
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "text-generation"),
        ({"architectures": ["ViTForImageClassification"], "model_type": "vit"}, "image-classification"),
        (
            {"architectures": ["LlavaForConditionalGeneration"], "vision_config": {}, "model_type": "llava"},
            "image-text-to-text",
        ),
        ({"architectures": ["BertModel"], "model_type": "bert"}, "feature-extraction"),
        ({"model_type": "bert"}, "feature-extraction"),  # no architectures: model_type decides
        ({"model_type": "idefics3"}, "image-text-to-text"),
        ({"model_type": "resnet"}, "image-classification"),
        ({"model_type": "qwen2"}, "text-generation"),
    ],
)
def test_infer_task(config, task):
    assert infer_task(config) == task


def test_infer_task_unknown_says_how_to_override():
    with pytest.raises(ValueError, match="pass task="):
        infer_task({"architectures": ["T5ForConditionalGeneration"], "model_type": "t5"})


def test_local_directory_task_from_config(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["ConvNextForImageClassification"], "model_type": "convnext"})
    )
    spec = resolve(str(tmp_path))
    assert (spec.task, spec.source, spec.gguf_file) == ("image-classification", str(tmp_path), None)
    assert resolve(str(tmp_path), task="feature-extraction").task == "feature-extraction"


def test_directory_without_config_is_explained(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        resolve(str(tmp_path))


def test_catalog_directory_and_gguf_path_resolve():
    spec = resolve("smollm2-135m")
    by_dir = resolve(spec.source)
    assert (by_dir.task, by_dir.hub_id) == ("text-generation", "HuggingFaceTB/SmolLM2-135M-Instruct")
    gguf = Path(spec.source) / json.loads((Path(spec.source) / "accelab.json").read_text())["gguf_file"]
    by_gguf = resolve(str(gguf))
    assert (by_gguf.task, by_gguf.source, by_gguf.gguf_file) == ("text-generation", str(gguf.parent), gguf.name)


def test_hub_id_resolves_from_local_hf_cache_when_offline(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="acme/tiny-vit is not in the local Hugging Face cache"):
        resolve("acme/tiny-vit")
    repo = tmp_path / "models--acme--tiny-vit"
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    (snapshot / "config.json").write_text(json.dumps({"architectures": ["ViTForImageClassification"]}))
    spec = resolve("acme/tiny-vit")
    assert (spec.task, spec.hub_id, Path(spec.source)) == ("image-classification", "acme/tiny-vit", snapshot)


def test_catalog_meta_matches_entry():
    for name, entry in CATALOG.items():
        if not entry.in_all:  # the large benchmark models: built by name only (test_llama_1b_*)
            continue
        spec = resolve(name)
        meta = json.loads((Path(spec.source) / "accelab.json").read_text())
        assert (meta["name"], meta["task"], meta["hub_id"]) == (name, entry.task, entry.hub_id)
        assert meta["random_weights"] == entry.random_weights


# Real models


def test_smollm2_answers_paris():
    model = loaded("smollm2-135m")
    assert model.model.dtype == torch.float32 and not model.model.training
    tokenizer = model.processor
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


@pytest.mark.slow
def test_gguf_path_loads_the_same_model_as_the_converted_weights():
    converted = loaded("smollm2-135m")
    gguf = load(resolve(str(Path(converted.spec.source) / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf")))
    batch = forward_batch(converted, 2, seq_len=16)
    assert torch.equal(batch["input_ids"], forward_batch(gguf, 2, seq_len=16)["input_ids"])
    with torch.no_grad():
        expected, actual = converted.model(**batch).logits, gguf.model(**batch).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-4)


def test_minilm_embeddings_rank_paraphrase_above_unrelated():
    model = loaded("minilm-l6")
    texts = [
        "A cat is sleeping on the warm bonnet of the car.",
        "The kitten is asleep on top of the warm car.",
        "The stock market fell sharply after the announcement.",
    ]
    batch = model.processor(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        vectors = embed(model.model(**batch), batch["attention_mask"])
    assert vectors.shape == (3, 384)
    assert torch.allclose(vectors.norm(dim=1), torch.ones(3), atol=1e-5)
    similar, unrelated = float(vectors[0] @ vectors[1]), float(vectors[0] @ vectors[2])
    assert similar > 0.6 > unrelated + 0.3


def test_embed_ignores_padding():
    hidden = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [100.0, 100.0]]])
    vector = embed(hidden, torch.tensor([[1, 1, 0]]))
    assert torch.allclose(vector, torch.tensor([[0.5, 0.5]]) / 0.5**0.5)


def test_max_sequence_length():
    assert max_sequence_length(loaded("smollm2-135m").model) == 8192
    assert max_sequence_length(loaded("minilm-l6").model) == 512
    assert max_sequence_length(loaded("smolvlm-tiny").model) == 2048
    assert max_sequence_length(loaded("vit-tiny").model) is None
    # a fresh tokenizer (encoding with truncation resets its backend's): it truncates at 128,
    # sentence-transformers' max_seq_length, under the 512 positions
    tokenizer = load_processor(resolve("minilm-l6"))
    assert max_sequence_length(loaded("minilm-l6").model, tokenizer) == 128


# Batches


@pytest.mark.parametrize(
    ("name", "kwargs", "shapes"),
    [
        ("smollm2-135m", {"seq_len": 64}, {"input_ids": (3, 64), "attention_mask": (3, 64)}),
        ("minilm-l6", {"seq_len": 32}, {"input_ids": (3, 32), "attention_mask": (3, 32), "token_type_ids": (3, 32)}),
        ("vit-tiny", {}, {"pixel_values": (3, 3, 32, 32)}),
        ("vit-base", {}, {"pixel_values": (3, 3, 224, 224)}),
        ("resnet-50", {"image_size": 160}, {"pixel_values": (3, 3, 160, 160)}),
        ("convnext-tiny", {}, {"pixel_values": (3, 3, 224, 224)}),
        (
            "smolvlm-tiny",
            {"seq_len": 96},
            {
                "input_ids": (3, 96),
                "attention_mask": (3, 96),
                "pixel_values": (3, 1, 3, 128, 128),
                "pixel_attention_mask": (3, 1, 128, 128),
            },
        ),
        (
            "llava-tiny",
            {"seq_len": 128},
            {"input_ids": (3, 128), "attention_mask": (3, 128), "pixel_values": (3, 3, 128, 128)},
        ),
    ],
)
def test_forward_batch_shapes_and_model_runs(name, kwargs, shapes):
    model = loaded(name)
    batch = forward_batch(model, 3, **kwargs)
    assert {k: tuple(v.shape) for k, v in batch.items()} == shapes
    synthetic = forward_batch(model, 3, synthetic=True, **kwargs)
    assert {k: tuple(v.shape) for k, v in synthetic.items()} == shapes
    main = "input_ids" if "input_ids" in batch else "pixel_values"
    assert not torch.equal(batch[main], synthetic[main])
    if name in ("vit-tiny", "resnet-50", "smolvlm-tiny", "llava-tiny"):  # cheap enough to run here
        with torch.no_grad():
            logits = model.model(**batch).logits
        assert logits.shape[0] == 3 and torch.isfinite(logits).all()


def test_forward_batch_text_is_right_padded_real_sentences():
    model = loaded("minilm-l6")
    batch = forward_batch(model, 2, seq_len=48, offset=5)
    decoded = model.processor.batch_decode(batch["input_ids"], skip_special_tokens=True)
    assert [d.lower() for d in decoded] == [s.lower() for s in sentences(2, offset=5)]
    assert batch["attention_mask"][:, 0].all() and not batch["attention_mask"][:, -1].any()


def test_forward_batch_offsets_differ():
    model = loaded("vit-tiny")
    assert not torch.equal(forward_batch(model, 2)["pixel_values"], forward_batch(model, 2, offset=2)["pixel_values"])


def test_seq_len_beyond_the_model_is_refused():
    with pytest.raises(ValueError, match=r"seq_len=600 .* 1 to 512"):
        forward_batch(loaded("minilm-l6"), 1, seq_len=600)


def test_fixed_size_vit_refuses_other_image_size():
    with pytest.raises(ValueError, match="image_size=64 does not fit vit-tiny"):
        forward_batch(loaded("vit-tiny"), 1, image_size=64)


def test_vlm_seq_len_too_short_for_image_tokens():
    with pytest.raises(ValueError, match="too short for llava-tiny"):
        forward_batch(loaded("llava-tiny"), 1, seq_len=40)


def test_generate_batch_is_left_padded_chat():
    model = loaded("smollm2-135m")
    batch = generate_batch(model, 4)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    lengths = mask.sum(dim=1)
    short = int(lengths.argmin())
    assert lengths[short] < ids.shape[1]  # the prompts differ in length, so one row is padded
    pad = model.processor.pad_token_id
    assert (ids[short, : ids.shape[1] - lengths[short]] == pad).all()
    assert not mask[short, 0] and mask[:, -1].all()
    text = model.processor.decode(ids[short, mask[short].bool()])
    assert text.endswith("<|im_start|>assistant\n") and prompts(4)[short] in text


def test_generate_batch_refuses_classifier():
    with pytest.raises(ValueError, match="generate needs"):
        generate_batch(loaded("vit-tiny"), 1)


@pytest.mark.parametrize("name", ["smolvlm-tiny", "llava-tiny"])
def test_vlm_generates_from_a_real_photo(name):
    model = loaded(name)
    batch = generate_batch(model, 2)
    assert not batch["attention_mask"][:, -1].eq(0).any()  # left padded
    out = model.model.generate(**batch, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape == (2, batch["input_ids"].shape[1] + 4)
    synthetic = generate_batch(model, 2, synthetic=True)
    image_token = model.processor.image_token_id
    assert torch.equal(synthetic["input_ids"] == image_token, batch["input_ids"] == image_token)


# Sample inputs


def test_text_samples():
    assert len(set(prompts(60))) >= 40 and len(set(sentences(300))) >= 200
    lengths = [len(p.split()) for p in prompts(52)]
    assert min(lengths) <= 8 and max(lengths) >= 40
    assert len(heldout_text().split()) >= 3000
    assert prompts(3, offset=52) == prompts(3)  # cycles


def test_photos_are_real_and_distinct():
    images = photos(30)
    assert all(im.mode == "RGB" and min(im.size) >= 200 for im in images)
    assert len({im.tobytes()[:4096] for im in images}) == 30
    assert photos(30)[20].tobytes() == images[20].tobytes()  # deterministic augmentation


def test_digits_split():
    train, test = digits("train", image_size=16), digits("test", image_size=16)
    assert (len(train[0]), len(test[0])) == (1437, 360)
    assert train[0][0].size == (16, 16) and train[0][0].mode == "RGB"
    assert sorted(set(test[1])) == list(range(10))
    assert digits("test", image_size=16)[1] == test[1]
    with pytest.raises(ValueError, match="split="):
        digits("valid")  # type: ignore[arg-type]  # a wrong split, on purpose


def test_llama_1b_has_llama_3_2_1bs_sizes_and_is_left_out_of_fetch_all():
    """The sizes are Llama-3.2-1B's (counted on the meta device, nothing allocated): 1.07B
    parameters with SmolLM2's 49152-token vocabulary (the output layer is the tied embedding);
    `--all` leaves it to be fetched by name."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from accelab.catalog.build_text import LLAMA_1B

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_1B, vocab_size=49152))
    count = sum(p.numel() for p in model.model.parameters())
    assert count == 16 * (2048 * (2048 + 512 + 512 + 2048) + 3 * 2048 * 8192) + 49152 * 2048 + 33 * 2048
    assert not CATALOG["llama-1b"].in_all and CATALOG["llama-1b"].random_weights


def test_llama_1b_builds_a_llama_with_smollm2s_tokenizer_that_the_serving_stack_takes(tmp_path):
    """The builder at small sizes (the real one is 1.9 GB): a bf16 Llama with SmolLM2's tokenizer
    and chat template, seeded (two builds are equal), that the serving steps run as plain tensor
    operations."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from accelab.catalog.build_text import LLAMA_1B, build_llama_1b
    from accelab.serve.runner.llama_stack import why_not

    small = {**LLAMA_1B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    small["num_key_value_heads"], small["head_dim"] = 2, 16
    steps: list[str] = []
    for name in ("a", "b"):
        build_llama_1b(tmp_path / name, steps.append, sizes=small)
    a, b = (AutoModelForCausalLM.from_pretrained(tmp_path / n) for n in ("a", "b"))
    assert a.dtype == torch.bfloat16 and a.config.rope_scaling["rope_type"] == "llama3"
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert a.config.vocab_size == len(tokenizer) == 49152 and tokenizer.chat_template
    assert why_not(a) is None
    assert any("saving" in line and "bf16 parameters" in line for line in steps)


def test_llama_8b_has_llama_3_1_8bs_sizes_and_is_left_out_of_fetch_all():
    """Llama-3.1-8B's sizes (counted on the meta device, nothing allocated): 7.38B parameters with
    SmolLM2's 49152-token vocabulary and an output layer of its own; fetched by name only."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from accelab.catalog.build_large import LLAMA_8B

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_8B, vocab_size=49152))
    count = sum(p.numel() for p in model.parameters())
    layers = 32 * (4096 * (4096 + 1024 + 1024 + 4096) + 3 * 4096 * 14336)
    assert count == layers + 2 * 49152 * 4096 + 65 * 4096 == 7_382_241_280
    assert not CATALOG["llama-8b"].in_all and CATALOG["llama-8b"].random_weights


def test_llama_8b_is_written_shard_by_shard_the_same_on_every_machine(tmp_path):
    """The builder at small sizes (the real one is 14.8 GB): bf16 shards of two layers each with
    their index, loadable by transformers; two builds are byte for byte equal; a tensor's values
    are the catalog's draw for its name (the digest below was taken on an AVX2 EPYC: another CPU
    kind must give the same, or two machines would benchmark different models); the norms are
    ones, the rest uniform with Llama's initialiser's standard deviation; the serving steps take it."""
    import hashlib

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from accelab.catalog.build_large import LLAMA_8B, build_llama_8b, random_tensor
    from accelab.serve.runner.llama_stack import why_not

    drawn = random_tensor("model.layers.0.mlp.up_proj.weight", (64, 128), 0.02)
    assert hashlib.sha256(drawn.view(torch.int16).numpy().tobytes()).hexdigest()[:16] == "46df6af9d3cd111f"
    small = {**LLAMA_8B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4}
    small["num_key_value_heads"], small["head_dim"] = 2, 16
    steps: list[str] = []
    for name in ("a", "b"):
        build_llama_8b(tmp_path / name, steps.append, sizes=small)
    shards = sorted(p.name for p in (tmp_path / "a").glob("*.safetensors"))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]  # layers 0-1, 2
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in shards)
    index = json.loads((tmp_path / "a" / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["model.layers.2.mlp.down_proj.weight"] == shards[1]
    assert index["weight_map"]["model.embed_tokens.weight"] == shards[0] and "lm_head.weight" in index["weight_map"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "a", dtype=torch.bfloat16)
    weights = model.state_dict()
    assert torch.equal(weights["model.layers.1.input_layernorm.weight"], torch.ones(64, dtype=torch.bfloat16))
    up = weights["model.layers.0.mlp.up_proj.weight"].float()
    assert abs(up.std().item() - model.config.initializer_range) < 0.002 and up.abs().max() < 0.035
    assert model.config.rope_scaling["rope_type"] == "llama3" and not model.config.tie_word_embeddings
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert model.config.vocab_size == len(tokenizer) == 49152 and tokenizer.chat_template
    assert why_not(model) is None
    assert any("one shard at a time" in line for line in steps) and any("wrote model-00002" in line for line in steps)


def test_smolvlm_256m_is_smollm2_with_a_vision_tower_of_smolvlms_shape(tmp_path):
    """The real-size VLM for the serving benchmark: SmolVLM-256M's vision tower (counted on the
    meta device: SigLIP base, 86M parameters) around SmolLM2-135M's own weights; the builder at a
    small vision size here (seeded by save_seeded, as every catalog build): the language model is
    SmolLM2's tensor for tensor, the processor gives one run of image tokens per image, the steps
    take it."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, Idefics3VisionConfig
    from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionTransformer

    from accelab.catalog.build_vlm import SMOLVLM_VISION, build_smolvlm_256m
    from accelab.catalog.samples import photos
    from accelab.serve.runner.llama_stack import why_not

    with torch.device("meta"):
        tower = Idefics3VisionTransformer(Idefics3VisionConfig(**SMOLVLM_VISION))
    assert 85e6 < sum(p.numel() for p in tower.parameters()) < 87e6
    assert not CATALOG["smolvlm-256m"].in_all and CATALOG["smolvlm-256m"].random_weights
    small = {**SMOLVLM_VISION, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
    small.update(num_attention_heads=4, image_size=64)
    build_smolvlm_256m(tmp_path / "a", lambda line: None, vision=small)
    a = AutoModelForImageTextToText.from_pretrained(tmp_path / "a")
    smollm2 = AutoModelForCausalLM.from_pretrained(resolve("smollm2-135m").source)
    mine, theirs = a.model.text_model.state_dict(), smollm2.model.state_dict()
    assert all(torch.equal(mine[k][: v.shape[0]], v) for k, v in theirs.items())  # the added tokens' rows follow
    assert why_not(a) is None
    processor = AutoProcessor.from_pretrained(tmp_path / "a")
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    text = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = processor(text=[text], images=[photos(1)[0]], return_tensors="pt")["input_ids"][0]
    assert int((ids == a.config.image_token_id).sum()) == (64 // 16) ** 2 // 4**2  # 16 patches shuffled by 4
