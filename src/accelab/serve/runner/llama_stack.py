"""The decoder stack of a Llama-shaped model (Llama, Mistral, Qwen2) as a few tensor operations
a layer, for the continuous steps: the same arithmetic as transformers' modules, without them.

Profiled at 8 decoding sequences of SmolLM2 (benchmarks/profile_serve_step.py), the model's own
forward spent about a third of each step outside any operator: 30 decoder layers of module calls,
keyword plumbing, decorators and the cache interface, around ~70 small operators a layer. Here a
layer is RMSNorm, one packed q|k|v GEMM, rotary embedding of q and k together, the KV write, paged
attention, the output GEMM and residual, RMSNorm, one packed gate|up GEMM, SiLU x up, the down
GEMM and residual: about 20 operators. Weights are the model's own (packed once for oneDNN on
CPU, `packed_linear`); rotary cos/sin come from the model's own rotary module, so its RoPE
scaling is what it is.

Only these exact classes with their plain shape are taken (`why_not` says why another is not);
the engine checks the stack's logits against the model's own forward at start-up and runs the
model's forward instead when they differ.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from accelab.catalog.facts import tensor_bytes, text_config
from accelab.measure import hardware
from accelab.measure.probes import SLOW_BELOW
from accelab.ops import int8_gemm
from accelab.plan import fit
from accelab.plan.quantized_load import trim_heap
from accelab.serve.runner import packed_linear
from accelab.serve.runner.kv_cache import PagedKVCache
from accelab.serve.runner.paged_attention import StepLayout, attend
from accelab.serve.runner.vision import vision_parts

log = logging.getLogger(__name__)

# decoder class -> where a layer's sliding window is read (None: the model has none)
WINDOWS: dict[str, Callable[[Any, Any], int | None] | None] = {
    "LlamaModel": None,
    "MistralModel": lambda config, attn: getattr(config, "sliding_window", None),
    "Qwen2Model": lambda config, attn: getattr(attn, "sliding_window", None),
}
Linear = Callable[[torch.Tensor], torch.Tensor]  # [T, in] -> [T, out]


def decoder_of(model: Any) -> Any:
    """The decoder (embeddings, layers, final norm) of a causal LM, or of a vision-language
    model's language part (Idefics3's text_model, LLaVA's language_model)."""
    parts = vision_parts(model)
    return parts[0] if parts is not None else getattr(model, "model", None)


def why_not(model: Any) -> str | None:
    """None when `model` is one this stack computes exactly, else the reason it is not."""
    decoder = decoder_of(model)
    name = type(decoder).__name__
    if name not in WINDOWS:
        return f"{type(model).__name__}'s decoder {name} is not one of {', '.join(WINDOWS)}"
    config = text_config(model.config)
    if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "pretraining_tp", 1) != 1:
        return "its MLP is not SiLU-gated, or it splits its layers for tensor-parallel pretraining"
    if getattr(config, "mlp_bias", False):
        return "its MLP has biases"
    layers = decoder.layers
    if len(layers) != config.num_hidden_layers:
        return "it runs another number of layers than it holds"
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if any(type(m) is not torch.nn.Linear for m in linears):
            return "a projection is not a plain nn.Linear (quantized?)"
        if any(not _plain(m.weight) and int8_rows(m.weight) is None for m in linears):
            return (
                "a projection's weight is quantized in a form other than int8 per row without activation quantization"
            )
        if mlp.gate_proj.bias is not None or attn.o_proj.bias is not None:
            return "its gate or output projection has a bias"
    if type(model.get_output_embeddings()) is not torch.nn.Linear or model.get_output_embeddings().bias is not None:
        return "its output layer is not a plain nn.Linear"
    return _dense_copies_too_big(model)


def _dense_copies_too_big(model: Any) -> str | None:
    """Why the stack's copies of the int8 weights cannot fit, or None. Where no int8 operator runs
    the activations' dtype here, the stack holds each int8 weight again dequantized (`_linear`):
    an 8B's int8 layers became ~28 GB of float32 and the kernel killed the server."""
    dense = 0
    for module in model.modules():
        rows = int8_rows(module.weight) if type(module) is torch.nn.Linear else None
        if rows is not None and int8_operator(module.weight.dtype, *rows[0].shape) is None:
            dense += rows[0].numel() * module.weight.dtype.itemsize
    room = fit.available_bytes() - fit.OVERHEAD_FIXED
    if dense and dense > room:
        return (
            f"no int8 operator runs its activations here, and its int8 weights dequantized would take "
            f"{dense / 1e9:.1f} GB more, with {max(room, 0) / 1e9:.1f} GB available"
        )
    return None


class LlamaStack:
    """`logits(ids, layout, cache, keep)`: one packed step of the model over the paged KV cache."""

    def __init__(self, model: Any, *, take_over: bool = False):
        """`take_over`: each layer's Linear weights leave the model as soon as the stack holds its
        own copy (`release_model_weights`, layer by layer), so loading them never holds them twice."""
        config = text_config(model.config)
        inner = decoder_of(model)
        self.model = model
        self.embed = inner.embed_tokens.weight
        self.rotary = inner.rotary_emb
        self.norm_weight, self.norm_eps = inner.norm.weight, inner.norm.variance_epsilon
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = inner.layers[0].self_attn.head_dim
        window_of = WINDOWS[type(inner).__name__]
        dtype = self.embed.dtype
        pack = packed_linear.available(self.embed.device, dtype)
        self.layers = []
        self.released = 0  # bytes of the model's weights handed over to this stack
        with torch.no_grad():
            for layer in inner.layers:
                attn, mlp = layer.self_attn, layer.mlp
                self.layers.append(
                    _Layer(
                        norm1=(layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
                        qkv=_linear([attn.q_proj, attn.k_proj, attn.v_proj], pack),
                        o=_linear([attn.o_proj], pack),
                        norm2=(layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon),
                        gate_up=_linear([mlp.gate_proj, mlp.up_proj], pack),
                        down=_linear([mlp.down_proj], pack),
                        scaling=attn.scaling,
                        window=window_of(config, attn) if window_of else None,
                        inter=mlp.gate_proj.out_features,
                    )
                )
                if take_over:
                    self.released += _release(_layer_linears(layer))
            self.head = _linear([model.get_output_embeddings()], pack)
            if take_over:
                self.released += _release(self._own_head())
        log.info(
            "the continuous steps run %s's %d layers as plain tensor operations", type(model).__name__, len(self.layers)
        )

    def release_model_weights(self) -> int:
        """The model's Linear weights that this stack holds in its own layout (every decoder
        layer's, and the head's unless it is the embedding itself) leave the model: each becomes a
        meta tensor of its shape, so the process holds them once. Returns the bytes released. The
        model's own forward cannot run after this; the stack's `logits` reads none of them."""
        modules = [m for layer in decoder_of(self.model).layers for m in _layer_linears(layer)]
        released = _release([*modules, *self._own_head()])
        self.released += released
        return released

    def _own_head(self) -> list[torch.nn.Linear]:
        """The output layer, unless it is the embedding (tied), which the stack reads still."""
        head = self.model.get_output_embeddings()
        return [] if head.weight is decoder_of(self.model).embed_tokens.weight else [head]

    def rotary_of(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary cos [T, 1, D] and sin' for `positions` [T], in `like`'s dtype. rotate_half(x) * sin
        == roll(x, half) * sin', where sin' is sin with its first half negated: one roll a layer
        instead of two slices, a negation and a concatenation."""
        cos, sin = self.rotary(like, positions[None])  # [1, T, D] each
        half = self.head_dim // 2
        return cos[0, :, None], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)[:, None]

    def logits(
        self,
        ids: torch.Tensor,
        layout: StepLayout,
        cache: PagedKVCache,
        keep: torch.Tensor,
        inserts: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """ids: [T] the step's tokens; keep: [N] the rows whose next token is picked -> logits [N, V].
        inserts: (rows [R], embeddings [R, H]) that replace those rows' token embeddings (images)."""
        t, hq, hkv, d = ids.shape[0], self.heads, self.kv_heads, self.head_dim
        h = F.embedding(ids, self.embed)  # [T, H]
        if inserts is not None:
            h = h.index_copy(0, inserts[0], inserts[1].to(h.dtype))
        cos, sin = self.rotary_of(h, layout.positions)
        half = d // 2
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(_rms(h, *layer.norm1))  # [T, (hq + 2 hkv) d]
            qk = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d)
            qk = qk * cos + qk.roll(half, dims=-1) * sin  # rotary embedding of q and k at once
            q, k = qk[:, :hq], qk[:, hq:]
            cache.write(i, layout.slots, k, qkv[:, (hq + hkv) * d :].view(t, hkv, d))
            attn = attend(q, cache, i, layout, scaling=layer.scaling, window=layer.window)  # [T, hq, d]
            h = h + layer.o(attn.reshape(t, hq * d))
            gate_up = layer.gate_up(_rms(h, *layer.norm2))  # [T, 2 I]
            h = h + layer.down(F.silu(gate_up[:, : layer.inter]) * gate_up[:, layer.inter :])
        return self.head(_rms(h.index_select(0, keep), self.norm_weight, self.norm_eps))


def _release(modules: list[torch.nn.Linear]) -> int:
    """Each module's weight becomes a meta tensor of its shape (a weight released before is
    skipped); the bytes they held, returned to the system."""
    released = 0
    for module in modules:
        weight = module.weight
        if weight.device.type == "meta":
            continue
        released += tensor_bytes(weight)
        module.weight = torch.nn.Parameter(
            torch.empty(weight.shape, dtype=weight.dtype, device="meta"), requires_grad=False
        )
    trim_heap()
    return released


def _layer_linears(layer: Any) -> list[torch.nn.Linear]:
    """A decoder layer's Linear modules, whose weights the stack packs."""
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]


@dataclass(frozen=True, kw_only=True, slots=True)
class _Layer:
    norm1: tuple[torch.Tensor, float]  # RMSNorm weight, epsilon
    qkv: Linear
    o: Linear
    norm2: tuple[torch.Tensor, float]
    gate_up: Linear
    down: Linear
    scaling: float
    window: int | None
    inter: int  # the MLP's width: gate_up's first half is the gate


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: in float32, scaled by the weight in the input's dtype. In
    float32 that is torch's own fused rms_norm (one operator instead of six)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _plain(weight: torch.Tensor) -> bool:
    return type(weight) in (torch.nn.Parameter, torch.Tensor)


def int8_rows(weight: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(int8 values [out, in], scales [out]) of a weight torchao quantized to int8 weight-only
    with one scale per output row (its Int8WeightOnlyConfig), else None."""
    qdata, scale = getattr(weight, "qdata", None), getattr(weight, "scale", None)
    if qdata is None or scale is None or qdata.dtype != torch.int8 or qdata.dim() != 2:
        return None
    if getattr(weight, "act_quant_kwargs", None) is not None:  # int8-dynamic: activations quantized too
        return None
    zero = getattr(weight, "zero_point", None)
    if scale.numel() != qdata.shape[0] or (zero is not None and bool(zero.any())):
        return None
    return qdata, scale.reshape(-1)


def _linear(modules: list[torch.nn.Linear], pack: bool) -> Linear:
    """One GEMM over the weights of `modules` side by side (they read one input): oneDNN on a
    packed copy (`pack`); where the weights are int8 per row, the int8 GEMM operator for the
    activations' dtype where it runs (`int8_gemm`), else in bf16 torch's int8 x bf16 kernel, else
    the dequantized weight."""
    int8 = [int8_rows(m.weight) for m in modules]
    dtype = modules[0].weight.dtype
    if all(rows is not None for rows in int8):
        values = torch.cat([rows[0] for rows in int8 if rows is not None])
        scales = torch.cat([rows[1] for rows in int8 if rows is not None])
        bias = _bias(modules, values.shape[0], dtype)
        kernel = int8_operator(dtype, *values.shape) if values.device.type == "cpu" else None
        if kernel is not None:
            return kernel.bind(values, scales, bias)
        if dtype == torch.bfloat16:
            scales = scales.to(dtype)
            if bias is None:
                return lambda x: torch.ops.aten._weight_int8pack_mm(x.contiguous(), values, scales)
            return lambda x: torch.ops.aten._weight_int8pack_mm(x.contiguous(), values, scales) + bias
    weight = torch.cat([_dense(m.weight) for m in modules])
    bias = _bias(modules, weight.shape[0], weight.dtype)
    if not pack:
        return lambda x: F.linear(x, weight, bias)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, packed_linear.BATCH_HINT)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def int8_operator(dtype: torch.dtype, out_features: int, in_features: int) -> int8_gemm.Kernel | None:
    """The int8 GEMM operator for `dtype` activations where it runs this weight here and `accelab env`
    did not measure it slower than the float GEMMs it replaces (its probe, when cached), else None:
    the engine then runs the dequantized weight."""
    kernel = int8_gemm.for_dtype(dtype)
    if kernel is None or kernel.available(out_features, in_features) is not None:
        return None
    if (why := _measured_slow(f"int8-gemm-{'bf16' if dtype == torch.bfloat16 else 'f32'}")) is not None:
        log.info("the %s operator is left out: `accelab env` %s", kernel.name, why)
        return None
    return kernel


@functools.cache
def _measured_slow(probe: str) -> str | None:

    limits = hardware.cached_limits("cpu")
    detail = limits.probe_details.get(probe) if limits is not None else None
    if detail is None or not detail.get("trusted", True) or detail.get("high") is None:
        return None
    return f"measured it at {detail['factor']:.2f}x the float32 GEMMs" if detail["high"] < SLOW_BELOW else None


def _dense(weight: Any) -> torch.Tensor:
    """The weight as a plain tensor (a quantized one dequantized where no int8 operator runs it)."""
    return weight.detach() if _plain(weight) else weight.dequantize().detach()


def _bias(modules: list[torch.nn.Linear], width: int, dtype: torch.dtype) -> torch.Tensor | None:
    biases = [m.bias for m in modules]
    if all(b is None for b in biases):
        return None
    parts = [
        b.detach().to(dtype) if b is not None else torch.zeros(m.out_features, dtype=dtype)
        for b, m in zip(biases, modules)
    ]
    bias = torch.cat(parts)
    assert bias.shape[0] == width
    return bias
