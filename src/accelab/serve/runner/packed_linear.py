"""The continuous steps' Linear layers on oneDNN with weights packed once (CPU).

A decoding step multiplies a few rows (one per sequence) by every weight of the model, so the
step is bound by how fast the GEMM streams weights. MKL's sgemm behind `F.linear` re-reads the
row-major weight for each call; oneDNN's inner-product with a weight reordered once into its
blocked layout (what inductor's freezing does on CPU) streamed SmolLM2's 210 layer weights
1.7-3x faster at 1-64 rows here (benchmarks/profile_serve_step.py has the figures). The packed
copy costs the weights' size again in memory, so it is taken only for float weights on CPU
with oneDNN present, and undone by `unpack`.

Sibling layers that read the same input (an attention's q/k/v projections, an MLP's gate and
up projections) are packed side by side into one weight: the first of them called computes
all their outputs in one GEMM and each sibling then takes its slice (`_Siblings`), so a
decoder layer makes 4 GEMM calls instead of 7. A sibling called with another input (a model
that transforms it in between) computes its own output from its own weight: always correct.

With `vit` (a vision tower), a pre-norm ViT encoder layer (CLIP's, SigLIP's, Idefics3's) runs
as one function of packed weights (`_vit_layer_forward`): q|k|v one GEMM whose output the
attention reads as strided views, and the output projection and fc2 adding the residual inside
oneDNN's GEMM (`_linear_pointwise.binary`; the layer's own two residual additions took ~6% of
SmolVLM-256M's tower time in bf16). A layer of another shape keeps its own forward, and a call
with an attention mask (padded patches) or in training runs it. Any other MLP of fc1 -> GELU ->
fc2 runs as one function of packed weights. In float32 the GELU runs inside fc1's oneDNN call
(SmolVLM-256M's tower spent 15% of its time in a separate GELU pass). In bfloat16 a tanh GELU
is computed as erf's: tanh's costs oneDNN 2.1 ms more than the GEMM itself at the tower's
[1024 x 768] -> 3072 (2.6 ms), and torch's bf16 tanh GELU alone 3.5 ms, where erf's after the
GEMM takes 0.74 ms. The two GELUs differ by
4.7e-4 at most (at x = 2.7), under a sixteenth of bf16's spacing there (2^-6): within the
rounding the plan already accepts, and the server's start-up check compares the result with
the model's own forward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeGuard

import torch
import torch.nn.functional as F

from accelab import cpu

log = logging.getLogger(__name__)

BATCH_HINT = 16  # rows oneDNN picks the weight layout for (1 to 64 rows all ran fastest with it)
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # layers that read one input
# oneDNN's GELU algorithm for transformers' GELU activations (QuickGELU has none: left unfused)
GELUS = {"GELUActivation": "none", "GELUTanh": "tanh", "PytorchGELUTanh": "tanh", "NewGELUActivation": "tanh"}


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packs float32 weights on any x86 CPU, and bfloat16 ones where the CPU computes
    bf16 natively (AVX512-BF16 or AMX: `torch.ops.mkldnn._is_mkldnn_bf16_supported`, and
    `accelab.cpu`'s flags, which ACCELAB_CPU_ISA may cap)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    if dtype == torch.float32:
        return True
    capped = not cpu.host_flags() or cpu.native_bf16()  # no /proc/cpuinfo: torch's probe alone
    return dtype == torch.bfloat16 and capped and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinears:
    """Every plain nn.Linear of `model` (but `skip`) computed by oneDNN from a packed copy of its
    weight; with `vit`, a pre-norm ViT layer as one function (`_vit_layer_forward`) and any other
    fc1 -> GELU -> fc2 MLP as one."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        skip: tuple[torch.nn.Module, ...] = (),
        batch_hint: int = BATCH_HINT,
        vit: bool = False,
    ):
        self._patched: list[torch.nn.Module] = []
        self._hint = batch_hint  # the rows a call usually has: a decoding step's few, an image's patches
        self.nbytes = 0
        self.fused = 0  # sibling groups packed as one weight
        self.mlps = 0  # MLPs run as one function
        self.vit_layers = 0  # ViT layers run as one function
        with torch.no_grad():
            for layer in model.modules() if vit else ():
                forward = _vit_layer_forward(layer, self._hint)
                if forward is not None:
                    self._own_forward(layer, forward, [*(_vit_linears(layer) or ()), layer.get_submodule("mlp")])
                    self.vit_layers += 1
            for parent in model.modules() if vit else ():
                if parent in self._patched:
                    continue
                gelu = _gelu_of(parent)
                if gelu is not None:
                    self._fuse_mlp(parent, gelu)
            for parent in model.modules():
                for names in SIBLINGS:
                    linears = [m for n in names if _packable(m := getattr(parent, n, None), skip)]
                    if any(m in self._patched for m in linears):
                        continue
                    if len(linears) == len(names) and len({(m.in_features, m.bias is None) for m in linears}) == 1:
                        self._fuse(linears)
            for module in model.modules():
                if not _packable(module, skip) or module in self._patched:
                    continue
                packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), self._hint)
                # an instance attribute shadows nn.Linear.forward (unpack deletes it)
                module.__dict__["forward"] = _packed_forward(packed, module.bias)
                self._patched.append(module)
                self.nbytes += module.weight.numel() * module.weight.element_size()
        log.info(
            "oneDNN packed weights for %d Linear layers (%d ViT layers, %d MLPs as one), %d sibling groups as one "
            "(%.0f MB more)",
            sum(isinstance(m, torch.nn.Linear) for m in self._patched),
            self.vit_layers,
            self.mlps,
            self.fused,
            self.nbytes / 1e6,
        )

    def _fuse(self, group: list[torch.nn.Linear]) -> None:
        weight = torch.cat([m.weight.detach() for m in group])  # [sum(out), in]
        bias = None if group[0].bias is None else torch.cat([m.bias.detach() for m in group if m.bias is not None])
        siblings = _Siblings(
            torch.ops.mkldnn._reorder_linear_weight(weight, self._hint), bias, [m.out_features for m in group]
        )
        for i, module in enumerate(group):
            module.__dict__["forward"] = siblings.forward_of(i, module)
            self._patched.append(module)
            self.nbytes += module.weight.numel() * module.weight.element_size()
        self.fused += 1

    def _fuse_mlp(self, mlp: torch.nn.Module, gelu: str) -> None:
        fc1, fc2 = mlp.get_submodule("fc1"), mlp.get_submodule("fc2")
        assert isinstance(fc1, torch.nn.Linear) and isinstance(fc2, torch.nn.Linear)
        first = torch.ops.mkldnn._reorder_linear_weight(fc1.weight.detach(), self._hint)
        second = torch.ops.mkldnn._reorder_linear_weight(fc2.weight.detach(), self._hint)
        bias1 = None if fc1.bias is None else fc1.bias.detach()
        bias2 = None if fc2.bias is None else fc2.bias.detach()

        exact = fc1.weight.dtype != torch.float32  # bf16: erf's GELU after the GEMM (module docstring)

        def mlp_rows(flat: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, in]: fc2(gelu(fc1(x)))
            if exact:
                inner = F.gelu(torch.ops.mkldnn._linear_pointwise(flat, first, bias1, "none", [], ""))
            else:
                inner = torch.ops.mkldnn._linear_pointwise(flat, first, bias1, "gelu", [], gelu)
            return torch.ops.mkldnn._linear_pointwise(inner, second, bias2, "none", [], "")

        def forward(x: torch.Tensor) -> torch.Tensor:
            return _by_rows(x, mlp_rows)

        self._own_forward(mlp, forward, [fc1, fc2])
        self.mlps += 1

    def _own_forward(self, module: torch.nn.Module, forward: Callable, inner: list[torch.nn.Module]) -> None:
        """`module` runs `forward`; its `inner` modules keep their own, listed so none is packed again."""
        module.__dict__["forward"] = forward
        self._patched.append(module)
        for part in inner:
            part.__dict__["forward"] = part.forward  # unpack deletes it: the class's forward again
            self._patched.append(part)
            if isinstance(part, torch.nn.Linear):
                self.nbytes += part.weight.numel() * part.weight.element_size()

    def __len__(self) -> int:
        return len(self._patched)

    def unpack(self) -> None:
        for module in self._patched:
            del module.forward  # back to nn.Linear.forward
        self._patched = []

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """The model's own Linear forward meanwhile (the reference the checks compare with)."""
        saved = [(m, m.__dict__.pop("forward")) for m in self._patched]
        try:
            yield
        finally:
            for module, forward in saved:
                module.__dict__["forward"] = forward


def _gelu_of(module: torch.nn.Module) -> str | None:
    """oneDNN's GELU algorithm when `module` is an MLP of plain Linear fc1 -> GELU -> fc2, else None."""
    fc1, fc2, act = (getattr(module, n, None) for n in ("fc1", "fc2", "activation_fn"))
    if not (_packable(fc1, ()) and _packable(fc2, ())) or act is None:
        return None
    if isinstance(act, torch.nn.GELU):
        return act.approximate
    return GELUS.get(type(act).__name__)


def _packable(module: Any, skip: tuple[torch.nn.Module, ...]) -> TypeGuard[torch.nn.Linear]:
    weight = module.weight if type(module) is torch.nn.Linear else None
    # a plain float weight: a quantized one (a torchao tensor subclass) keeps its own kernel
    return (
        weight is not None and type(weight) is torch.nn.Parameter and module not in skip and weight.is_floating_point()
    )


class _Siblings:
    """Layers that read one input, computed by one GEMM over their weights side by side. The
    outputs of the last input wait for the siblings not called yet (held with that input, so an
    identity check cannot be fooled by a reused address)."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None, widths: list[int]):
        self.packed, self.bias, self.widths = packed, bias, widths
        self._input: torch.Tensor | None = None
        self._outputs: list[torch.Tensor | None] = []

    def _rows(self, flat: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, sum of widths]
        return torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")

    def forward_of(self, index: int, module: torch.nn.Linear):
        def forward(x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out of this sibling]
            if x is not self._input or self._outputs[index] is None:
                if x is self._input:  # called twice on one input: its own weight, no stale slices
                    return F.linear(x, module.weight, module.bias)
                parts = _by_rows(x, self._rows).split(self.widths, dim=-1)
                self._input, self._outputs = x, list(parts)
            part, self._outputs[index] = self._outputs[index], None
            if all(o is None for o in self._outputs):
                self._input = None  # every sibling took its slice: let the input go
            assert part is not None
            return part

        return forward


def _packed_forward(packed: torch.Tensor, bias: Any):
    bias = None if bias is None else bias.detach()

    def rows(flat: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out]
        return torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")

    def forward(x: torch.Tensor) -> torch.Tensor:
        return _by_rows(x, rows)

    return forward


def _by_rows(x: torch.Tensor, compute: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`compute` over x as one contiguous matrix of rows [-1, in], back in x's leading dims."""
    flat = x.reshape(-1, x.shape[-1])
    out = compute(flat if flat.is_contiguous() else flat.contiguous())
    return out.reshape(*x.shape[:-1], out.shape[-1])


VIT_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "mlp.fc1", "mlp.fc2")


def _vit_linears(layer: Any) -> list[torch.nn.Linear] | None:
    """The layer's six Linear layers, when it is a pre-norm ViT layer this module can run."""
    if not all(isinstance(getattr(layer, n, None), torch.nn.LayerNorm) for n in ("layer_norm1", "layer_norm2")):
        return None
    attention = getattr(layer, "self_attn", None)
    if not all(isinstance(getattr(attention, n, None), (int, float)) for n in ("num_heads", "head_dim", "scale")):
        return None
    linears = [_submodule(layer, name) for name in VIT_LINEARS]
    if not all(_packable(m, ()) and m.bias is not None for m in linears):
        return None
    if getattr(layer, "mlp", None) is None or getattr(layer.mlp, "activation_fn", None) is None:
        return None
    return linears


def _vit_layer_forward(layer: Any, hint: int) -> Callable[..., torch.Tensor] | None:
    """A pre-norm ViT layer's forward over packed weights (oneDNN's layout for `hint` rows), or
    None where the layer is not one (module docstring)."""
    linears = _vit_linears(layer)
    if linears is None:
        return None
    q, k, v, out, fc1, fc2 = linears
    own = type(layer).forward.__get__(layer)
    attention = layer.self_attn
    heads, head_dim, scale = int(attention.num_heads), int(attention.head_dim), float(attention.scale)
    norm1, norm2, act = layer.layer_norm1, layer.layer_norm2, layer.mlp.activation_fn

    def pack(weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), hint)

    qkv_weight = pack(torch.cat([q.weight, k.weight, v.weight]))
    qkv_bias = torch.cat([q.bias, k.bias, v.bias]).detach()
    out_weight, fc1_weight, fc2_weight = pack(out.weight), pack(fc1.weight), pack(fc2.weight)
    out_bias, fc1_bias, fc2_bias = out.bias.detach(), fc1.bias.detach(), fc2.bias.detach()
    gelu = _gelu_of(layer.mlp)
    fused_gelu = gelu if gelu is not None and fc1.weight.dtype == torch.float32 else None
    exact_gelu = gelu is not None and fused_gelu is None  # bf16: erf's GELU (packed_linear's docstring)

    def activation(flat: torch.Tensor) -> torch.Tensor:
        if fused_gelu is not None:
            return torch.ops.mkldnn._linear_pointwise(flat, fc1_weight, fc1_bias, "gelu", [], fused_gelu)
        inner = torch.ops.mkldnn._linear_pointwise(flat, fc1_weight, fc1_bias, "none", [], "")
        return F.gelu(inner) if exact_gelu else act(inner)

    def forward(hidden_states: torch.Tensor, attention_mask: Any = None, *args: Any, **kwargs: Any) -> torch.Tensor:
        if attention_mask is not None or args or kwargs or layer.training or hidden_states.dim() != 3:
            return own(hidden_states, attention_mask, *args, **kwargs)
        batch, seq, width = hidden_states.shape
        x = hidden_states.reshape(batch * seq, width)
        x = x if x.is_contiguous() else x.contiguous()
        qkv = torch.ops.mkldnn._linear_pointwise(norm1(x), qkv_weight, qkv_bias, "none", [], "")
        qs, ks, vs = qkv.view(batch, seq, 3, heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        heads_out = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)  # [batch, heads, seq, head_dim]
        joined = heads_out.transpose(1, 2).reshape(batch * seq, heads * head_dim)
        x = torch.ops.mkldnn._linear_pointwise.binary(joined, x, out_weight, out_bias, "add")
        x = torch.ops.mkldnn._linear_pointwise.binary(activation(norm2(x)), x, fc2_weight, fc2_bias, "add")
        return x.view(batch, seq, width)

    return forward


def _submodule(layer: torch.nn.Module, name: str) -> Any:
    try:
        return layer.get_submodule(name)
    except AttributeError:
        return None
