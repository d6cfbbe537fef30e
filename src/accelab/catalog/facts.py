"""Facts about a model that every part of accelab reads the same way: which transformers class
loads a task, which tasks generate, the language model's config, the longest sequence the model
accepts and the bytes its weights take.

Pure functions of a config, a model or a tokenizer: no loading, no Hub, no device. torch is
imported only by `weight_bytes`, so the parent process can ask the other questions cheaply.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard

if TYPE_CHECKING:
    import torch

# task -> the transformers auto class `from_pretrained` builds it with
MODEL_CLASSES = {
    "text-generation": "AutoModelForCausalLM",
    "feature-extraction": "AutoModel",
    "image-classification": "AutoModelForImageClassification",
    "image-text-to-text": "AutoModelForImageTextToText",
}
GENERATE_TASKS = ("text-generation", "image-text-to-text")

# config fields that hold the position limit, by model family (llama/bert, gpt2, mpt, qwen)
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")
# transformers' "no limit" for a tokenizer's model_max_length is int(1e30)
_NO_LIMIT = 1_000_000


def text_config(config: Any) -> Any:
    """The config of the language model: the decoder of a VLM, else the config itself. Takes a
    transformers config or config.json read as a dict (the parent checks shapes without
    importing transformers)."""
    if isinstance(config, dict):
        return config.get("text_config", config)
    get = getattr(config, "get_text_config", None)
    return get() if get is not None else config


def max_sequence_length(model_or_config: Any, tokenizer: Any = None) -> int | None:
    """Longest input, in tokens, the model accepts; None when nothing says (models without text
    input). From its position embeddings; with `tokenizer`, the shorter of those and the
    tokenizer's own truncation length (a sentence-transformers model's max_seq_length) or
    model_max_length: an encoder was trained on no more than that."""
    config = getattr(model_or_config, "config", model_or_config)
    limits = [_positions(text_config(config)) if config is not None else None]
    if tokenizer is not None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        truncation = getattr(backend, "truncation", None) or {}
        limits += [truncation.get("max_length"), getattr(tokenizer, "model_max_length", None)]
    sane = [n for n in limits if isinstance(n, int) and 0 < n < _NO_LIMIT]
    return min(sane) if sane else None


def _positions(config: Any) -> int | None:
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    for key in _POSITION_KEYS:
        value = get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers a forward reads, as stored.

    This is the formula every caller uses (the roofline's bytes per decoded token, the size of a
    model to split over devices). It counts what memory holds, which a sum of numel x dtype
    size gets wrong twice: quantized tensor subclasses (torchao) count their inner tensors
    (int8 data + scales + ...), not the logical dtype they pretend to be; tensors sharing
    storage (tied embeddings, views of one fused weight) count the bytes of that storage they
    cover, once. A meta model built at the load dtype counts numel x its tensors' dtype: the
    bytes `from_pretrained` at that dtype will allocate."""
    spans: dict[tuple[str, int], list[tuple[int, int]]] = defaultdict(list)
    unshared = 0
    for tensor in _leaf_tensors(_unique(model)):
        key, span = _storage_span(tensor)
        if key is None:
            unshared += span[1] - span[0]
        else:
            spans[key].append(span)
    return unshared + sum(_union_length(s) for s in spans.values())


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes one tensor holds as stored: a quantized subclass's inner tensors (int8 data, scales)."""
    return sum(t.numel() * t.element_size() for t in _leaf_tensors([tensor]))


def _unique(model: torch.nn.Module) -> Iterable[torch.Tensor]:
    # remove_duplicate drops the same Parameter object registered twice; shared storage
    # under different objects is handled by _storage_span.
    yield from model.parameters()
    yield from model.buffers()


def _leaf_tensors(tensors: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]:
    """Plain tensors; a wrapper subclass is replaced by its inner tensors, recursively."""
    for tensor in tensors:
        if _is_wrapper_subclass(tensor):
            names, _ = tensor.__tensor_flatten__()
            yield from _leaf_tensors(getattr(tensor, name) for name in names)
        else:
            yield tensor


class _WrapperTensor(Protocol):
    """A tensor subclass that wraps plain tensors (torchao's quantized weights): it names them."""

    def __tensor_flatten__(self) -> tuple[list[str], Any]: ...


def _is_wrapper_subclass(tensor: torch.Tensor) -> TypeGuard[_WrapperTensor]:
    import torch

    try:
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    except ImportError:  # private helper; its contract is "has __tensor_flatten__"
        return hasattr(tensor, "__tensor_flatten__") and type(tensor) not in (torch.Tensor, torch.nn.Parameter)
    return is_traceable_wrapper_subclass(tensor)


def _storage_span(tensor: torch.Tensor) -> tuple[tuple[str, int] | None, tuple[int, int]]:
    """(storage key, [start, end) bytes in that storage); key None when it has no real storage
    (meta tensors, exotic subclasses): then the span is just numel * element_size."""
    size = tensor.element_size()
    try:
        if tensor.is_meta:
            raise RuntimeError("meta tensors have no storage")
        ptr = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None, (0, tensor.numel() * size)
    if tensor.numel() == 0 or ptr == 0:
        return None, (0, 0)
    # Elements reachable from the first one: 1 + sum((dim - 1) * stride); stride 0 (expand)
    # reads the same memory again, and counts once.
    extent = 1 + sum((int(dim) - 1) * abs(int(stride)) for dim, stride in zip(tensor.shape, tensor.stride()))
    start = int(tensor.storage_offset()) * size
    return (str(tensor.device), ptr), (start, start + extent * size)


def _union_length(spans: list[tuple[int, int]]) -> int:
    total, reach = 0, 0
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total
