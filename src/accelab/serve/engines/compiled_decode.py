"""The decoding steps of the plain-tensor stack, compiled (a plan with `compile` on).

A step in which every sequence decodes one token is most of a served load's steps, and its
shape is always the same but for two sizes: B sequences, and the widest block table. Profiled at
8 sequences of SmolLM2 in bf16 (benchmarks/profile_serve_step.py), the eager stack's step spent
12 of its 27 ms in the GEMMs and the rest in ~40 small operators a layer and their dispatch.
Compiled once with those two sizes symbolic (inductor: weights frozen and packed for oneDNN,
the small operators fused into a few C++ kernels a layer, the C++ wrapper in place of Python's
kernel calls), the same step took 22 ms, with the same greedy tokens.

Only decoding steps take this path; a step with a prefill chunk or an image runs the eager
stack. The batch is padded to two rows at least (the last row repeated: it writes the same KV
slot with the same values) and the block tables to two columns (block 0, masked), so a size
of 1 never specialises the graph and one compile serves every batch. The first call compiles
(about a minute for a 30-layer model on 2 cores; inductor's cache on disk makes a restart
quicker); the engine makes it at start-up, in its check against the eager stack.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch._inductor.config as inductor_config
import torch.fx.experimental._config as fx_config
import torch.nn.functional as F

from accelab.serve.engines.base import SamplingParams, StepInput
from accelab.serve.engines.kv_cache import PagedKVCache
from accelab.serve.engines.llama_stack import LlamaStack, decoder_of, int8_rows

log = logging.getLogger(__name__)

# inductor's settings while the step compiles: weights as constants (packed for oneDNN), C++
# kernel calls. Set on its config: given as torch.compile's `options` they did not take effect
# here (compiled in half the time, to a step no faster than eager: 26.7 against 19.6 ms).
OPTIONS = {"freezing": True, "cpp_wrapper": True}
MIN_SIZE = 2  # rows and table columns are padded to this: torch.compile specialises sizes 0 and 1


def why_not(model: Any) -> str | None:
    """None when the decoding step of `model`'s stack can be compiled, else why not."""
    inner = decoder_of(model)
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            if int8_rows(m.weight) is not None or type(m.weight) is not torch.nn.Parameter:
                return "its weights are quantized (the compiled step takes float weights)"
    return None


def check(
    forward: Callable[..., torch.Tensor],
    prompt: list[int],
    blocks: tuple[int, ...],
    tolerance: Callable[[torch.dtype], float],
) -> str | None:
    """None when the compiled decoding step (compiled here, by its first call) gives the eager
    steps' logits for one token after `prompt`, else what differed or failed. `forward(inputs,
    compiled=)` is the engine's step; the check's sequence (id -1) holds `blocks`."""
    greedy = SamplingParams(max_tokens=1, temperature=0)
    first = StepInput(seq_id=-1, start=0, tokens=tuple(prompt), sample=True, params=greedy, blocks=blocks)
    try:
        nxt = int(forward([first], compiled=False)[0].argmax())
        decode = replace(first, start=len(prompt), tokens=(nxt,))
        want = forward([decode], compiled=False)[0]
        got = forward([decode])[0]
    except Exception as err:  # noqa: BLE001 - a compile that fails leaves the eager steps
        return f"compiling it failed: {type(err).__name__}: {err}"
    error = float((got.float() - want.float()).abs().max()) / (float(want.abs().max()) or 1.0)
    if error > tolerance(got.dtype):
        return f"its logits differ from the eager steps' by {error:.2%} of their scale"
    return None


class _Decode(torch.nn.Module):
    """One decoding token for each of B sequences -> their logits [B, V]: the stack's arithmetic
    written for one query a sequence, so inductor sees one graph."""

    def __init__(self, model: Any, stack: LlamaStack, block_size: int):
        super().__init__()
        inner = decoder_of(model)

        def frozen(t: torch.Tensor) -> torch.nn.Parameter:
            return torch.nn.Parameter(t.detach(), requires_grad=False)

        def joined(modules: Sequence[torch.nn.Linear]) -> tuple[torch.nn.Parameter, torch.nn.Parameter | None]:
            weight = frozen(torch.cat([m.weight for m in modules]))
            if all(m.bias is None for m in modules):
                return weight, None
            parts = [m.bias if m.bias is not None else torch.zeros(m.out_features) for m in modules]
            return weight, frozen(torch.cat([p.to(weight.dtype) for p in parts]))

        self.embed = frozen(inner.embed_tokens.weight)
        self.head = frozen(model.get_output_embeddings().weight)
        self.norm = frozen(stack.norm_weight)
        self.eps = stack.norm_eps
        self.heads, self.kv_heads, self.head_dim = stack.heads, stack.kv_heads, stack.head_dim
        self.block_size = block_size
        self.windows = [layer.window for layer in stack.layers]
        self.scalings = [layer.scaling for layer in stack.layers]
        self.epsilons = [(layer.norm1[1], layer.norm2[1]) for layer in stack.layers]
        self.norms = torch.nn.ParameterList()
        self.weights = torch.nn.ParameterList()
        self.biases = torch.nn.ParameterList()  # the q|k|v biases there are
        self.bias_of: list[int | None] = []  # each layer's index in `biases`
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, qkv_bias = joined([attn.q_proj, attn.k_proj, attn.v_proj])
            gate_up, _ = joined([mlp.gate_proj, mlp.up_proj])
            self.norms.extend([frozen(layer.input_layernorm.weight), frozen(layer.post_attention_layernorm.weight)])
            self.weights.extend([qkv, frozen(attn.o_proj.weight), gate_up, frozen(mlp.down_proj.weight)])
            self.bias_of.append(None if qkv_bias is None else len(self.biases))
            if qkv_bias is not None:
                self.biases.append(qkv_bias)

    def forward(
        self,
        ids: torch.Tensor,  # [B]
        cos: torch.Tensor,  # [B, 1, D] rotary cos, sin with its first half negated (as the stack)
        sin: torch.Tensor,
        slots: torch.Tensor,  # [B] where each new key and value goes
        positions: torch.Tensor,  # [B]
        tables: torch.Tensor,  # [B, N] block ids
        keys: list[torch.Tensor],  # per layer [blocks, block_size, kv_heads, head_dim]
        values: list[torch.Tensor],
    ) -> torch.Tensor:
        b, hq, hkv, d = ids.shape[0], self.heads, self.kv_heads, self.head_dim
        group, half = hq // hkv, d // 2
        length = tables.shape[1] * self.block_size
        device = ids.device
        where = (tables[:, :, None] * self.block_size + torch.arange(self.block_size, device=device)).reshape(b, length)
        seen = torch.arange(length, device=device)[None]  # [1, L]
        masks: dict[int | None, torch.Tensor] = {}
        h = F.embedding(ids, self.embed)
        for i, window in enumerate(self.windows):
            mask = masks.get(window)
            if mask is None:
                mask = seen <= positions[:, None]
                if window:
                    mask = mask & (seen > positions[:, None] - window)
                mask = masks[window] = mask[:, None, None]  # [B, 1, 1, L]
            qkv_w, o_w, gate_up_w, down_w = self.weights[4 * i : 4 * i + 4]
            eps1, eps2 = self.epsilons[i]
            at = self.bias_of[i]
            bias = None if at is None else self.biases[at]
            qkv = F.linear(_rms(h, self.norms[2 * i], eps1), qkv_w, bias)
            qk = qkv[:, : (hq + hkv) * d].view(b, hq + hkv, d)
            qk = qk * cos + qk.roll(half, dims=-1) * sin
            q, k = qk[:, :hq], qk[:, hq:]
            v = qkv[:, (hq + hkv) * d :].view(b, hkv, d)
            flat_k, flat_v = keys[i].view(-1, hkv, d), values[i].view(-1, hkv, d)
            flat_k.index_copy_(0, slots, k)
            flat_v.index_copy_(0, slots, v)
            seq_k, seq_v = flat_k[where].float(), flat_v[where].float()  # [B, L, KVH, D]
            scores = torch.einsum("bhgd,blhd->bhgl", q.reshape(b, hkv, group, d).float(), seq_k) * self.scalings[i]
            probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
            attn = torch.einsum("bhgl,blhd->bhgd", probs, seq_v).to(h.dtype).reshape(b, hq * d)
            h = h + F.linear(attn, o_w)
            gate_up = F.linear(_rms(h, self.norms[2 * i + 1], eps2), gate_up_w)
            inter = gate_up.shape[1] // 2
            h = h + F.linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], down_w)
        return F.linear(_rms(h, self.norm, self.eps), self.head)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The stack's RMSNorm (transformers' arithmetic: float32, then the weight in x's dtype)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class CompiledDecode:
    """`logits(inputs, layout, cache)` for a step in which every input decodes one token. Once
    compiled, a call that would compile again raises torch._dynamo.exc.RecompileError, before
    anything is written: the engine then steps eager."""

    def __init__(self, model: Any, stack: LlamaStack, block_size: int, mode: str):
        self._stack = stack
        self._module = _Decode(model, stack, block_size).eval()
        self._options = dict(OPTIONS, max_autotune=mode.startswith("max-autotune"))
        self._step = torch.compile(self._module)
        self.steps = 0  # decoding steps it ran
        self.compiled = False

    @staticmethod
    def takes(inputs: Sequence[Any]) -> bool:
        return all(len(item.tokens) == 1 and item.sample and not item.images for item in inputs)

    def logits(self, inputs: Sequence[Any], layout: Any, cache: PagedKVCache) -> torch.Tensor:
        """Logits [len(inputs), V]; `layout` is the step's StepLayout (one group: the decodes)."""
        n = len(inputs)
        group = layout.groups[0]
        rows = torch.arange(max(n, MIN_SIZE)).clamp_(max=n - 1)  # the last row again, up to two
        ids = torch.tensor([item.tokens[0] for item in inputs])[rows]
        positions, slots, tables = layout.positions[rows], layout.slots[rows], group.tables[rows]
        if tables.shape[1] < MIN_SIZE:
            tables = F.pad(tables, (0, MIN_SIZE - tables.shape[1]))  # block 0, masked: past every position
        cos, sin = self._stack.rotary_of(cache.keys[0].new_empty(0), positions)
        for tensor in (ids, cos, sin, slots, positions, tables):
            torch._dynamo.mark_dynamic(tensor, 0)
        torch._dynamo.mark_dynamic(tables, 1)
        if self.compiled:  # never a second compile mid-serving (a minute's stall): RecompileError instead
            with torch._dynamo.config.patch(error_on_recompile=True):
                out = self._step(ids, cos, sin, slots, positions, tables, cache.keys, cache.values)
        else:  # the first call compiles: rows and columns get sizes of their own (no duck sizing)
            with fx_config.patch(use_duck_shape=False), inductor_config.patch(self._options):  # type: ignore[attr-defined]
                out = self._step(ids, cos, sin, slots, positions, tables, cache.keys, cache.values)
            self.compiled = True
        self.steps += 1
        return out[:n]
