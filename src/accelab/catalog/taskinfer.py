"""Infer a model's task from its config.json. Pure logic: a dict in, a task name out."""

from __future__ import annotations

from accelab.catalog.spec import TASKS, Task

# Encoder-only model types whose bare model gives token features (sentence embeddings).
# Checked before the causal-LM mapping, which also lists some of them (BertLMHeadModel).
ENCODER_TYPES = frozenset(
    {
        "bert",
        "roberta",
        "xlm-roberta",
        "distilbert",
        "albert",
        "electra",
        "mpnet",
        "deberta",
        "deberta-v2",
        "camembert",
        "modernbert",
        "nomic_bert",
        "xlm",
        "ernie",
        "megatron-bert",
    }
)
VISION_CONFIG_KEYS = ("vision_config", "vision_tower", "visual")


def infer_task(config: dict, mappings: dict[Task, frozenset[str]] | None = None) -> Task:
    """The task of a model given its config dict.

    `architectures` decide first (*ForCausalLM, *ForImageClassification, *ForConditionalGeneration
    or *ImageTextToText with a vision config, *Model / *ForMaskedLM of an encoder); otherwise
    `model_type` is looked up in `mappings` (task -> model types; by default transformers' auto
    mappings). Raises ValueError when neither says, naming the task override.
    """
    for arch in config.get("architectures") or []:
        task = _task_of_architecture(arch, config)
        if task is not None:
            return task
    model_type = config.get("model_type")
    if model_type in ENCODER_TYPES:
        return "feature-extraction"
    for task, types in (mappings if mappings is not None else _auto_mappings()).items():
        if model_type in types:
            return task
    raise ValueError(
        f"cannot infer the task of a model with architectures={config.get('architectures')} and "
        f"model_type={model_type!r}; pass task= (--task) with one of: {', '.join(TASKS)}"
    )


def _has_vision(config: dict) -> bool:
    return any(key in config for key in VISION_CONFIG_KEYS)


def _task_of_architecture(arch: str, config: dict) -> Task | None:
    if arch.endswith("ForCausalLM") or arch.endswith("LMHeadModel"):
        return "text-generation"
    if arch.endswith("ForImageClassification"):
        return "image-classification"
    if (arch.endswith("ForConditionalGeneration") or "ImageTextToText" in arch) and _has_vision(config):
        return "image-text-to-text"
    is_decoder = config.get("is_decoder", False)
    if (arch.endswith("Model") or arch.endswith("ForMaskedLM")) and not is_decoder:
        if config.get("model_type") in ENCODER_TYPES or "Bert" in arch:
            return "feature-extraction"
    return None


def _auto_mappings() -> dict[Task, frozenset[str]]:
    # Order matters: a VLM type may also appear in the causal-LM mapping.
    from transformers.models.auto import modeling_auto as auto

    return {
        "image-text-to-text": frozenset(auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES),
        "image-classification": frozenset(auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES),
        "text-generation": frozenset(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
    }
