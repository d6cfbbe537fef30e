"""accelab.catalog.facts on hand-made configs and tokenizers: no model is loaded."""

from __future__ import annotations

from types import SimpleNamespace

from accelab.catalog.facts import GENERATE_TASKS, MODEL_CLASSES, max_sequence_length, text_config


class VLMConfig(SimpleNamespace):
    def get_text_config(self):
        return self.text_config


def test_every_task_has_a_model_class_and_the_generating_ones_are_tasks():
    assert set(MODEL_CLASSES) == {"text-generation", "feature-extraction", "image-classification", "image-text-to-text"}
    assert set(GENERATE_TASKS) <= set(MODEL_CLASSES)


def test_text_config_of_a_vlm_a_plain_config_and_a_config_json_dict():
    decoder = SimpleNamespace(max_position_embeddings=2048)
    assert text_config(VLMConfig(text_config=decoder)) is decoder
    plain = SimpleNamespace(max_position_embeddings=512)
    assert text_config(plain) is plain
    assert text_config({"text_config": {"n_positions": 64}}) == {"n_positions": 64}
    assert text_config({"n_positions": 64}) == {"n_positions": 64}


def test_max_sequence_length_from_each_family_key_of_a_model_config_or_dict():
    assert max_sequence_length(SimpleNamespace(config=SimpleNamespace(max_position_embeddings=8192))) == 8192
    assert max_sequence_length(SimpleNamespace(n_positions=1024)) == 1024  # gpt2
    assert max_sequence_length({"max_seq_len": 2048}) == 2048  # mpt
    assert max_sequence_length({"seq_length": 4096}) == 4096  # qwen
    assert max_sequence_length({"text_config": {"max_position_embeddings": 2048}}) == 2048
    assert max_sequence_length(VLMConfig(text_config=SimpleNamespace(max_position_embeddings=16384))) == 16384


def test_max_sequence_length_is_none_without_a_limit():
    assert max_sequence_length(SimpleNamespace(image_size=224)) is None  # a vision model
    assert max_sequence_length(SimpleNamespace(config=None)) is None
    assert max_sequence_length({"max_position_embeddings": 0}) is None
    assert max_sequence_length({"max_position_embeddings": "512"}) is None


def test_a_tokenizer_bounds_the_positions_and_its_no_limit_is_ignored():
    config = SimpleNamespace(max_position_embeddings=512)
    truncating = SimpleNamespace(
        backend_tokenizer=SimpleNamespace(truncation={"max_length": 128}), model_max_length=512
    )
    assert max_sequence_length(config, truncating) == 128
    unbounded = SimpleNamespace(backend_tokenizer=SimpleNamespace(truncation=None), model_max_length=int(1e30))
    assert max_sequence_length(config, unbounded) == 512
    assert max_sequence_length(SimpleNamespace(), SimpleNamespace(model_max_length=256)) == 256
    assert max_sequence_length(SimpleNamespace(), unbounded) is None
