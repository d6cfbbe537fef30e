"""The continuous steps of the plain-tensor stack, compiled (a plan with `compile` on).

A step in which every sequence decodes one token is most of a served load's steps, and its
shape is always the same but for two sizes: B sequences, and the widest block table. Profiled at
8 sequences of SmolLM2 in bf16 (benchmarks/profile_serve_step.py), the eager stack's step spent
12 of its 27 ms in the GEMMs and the rest in ~40 small operators a layer and their dispatch.
Compiled once with those two sizes symbolic (inductor: weights frozen and packed for oneDNN,
the small operators fused into a few C++ kernels a layer, the C++ wrapper in place of Python's
kernel calls), the same step took 19.4 ms (24.4 against 33.8 at 16 sequences), with the same
greedy tokens.

Inside the graph the decoding attention is the C++ kernel of `decode_attention` (an operator
inductor calls; it reads the blocks in place): SmolLM2 bf16 served at 16 users, 483-489 tok/s
against 354 with the tensor-op attention (the server's step 27.3 against 35.9 ms). int8 weights
(the int8-bf16 plan) stay int8 in the graph, which calls the AMX int8 GEMM of `int8_gemm` for
them: half the bytes of a step bound by reading its weights (SmolLM2 served at 8 users 361-369
against 305-311 tok/s in bf16).

A step that carries a new request's prefill chunk runs a second graph, grouped as the eager
stack groups it: the decoding sequences attend as one group (one query each), the chunks as
another (their queries padded to the longest chunk); a step of 15 decodes and a 43-token chunk
took 36.6 ms against 50.7 eager. (One group for all, the decodes padded to the chunk's length,
took 59 ms and slowed plain decoding steps by 6-9%: not kept.) A chunk whose padded attention
would pass SCORES_LIMIT, and a step with an image, run eager.

Every size is padded to two at least (the last row repeated: it writes the same KV slots with
the same values; table columns of block 0, masked), so a size of 1 never specialises a graph
and one compile of each serves every step. The first calls compile (about a minute each for a
30-layer model on 2 cores; inductor's cache on disk makes a restart quicker); the engine makes
them at start-up, in its check against the eager stack, and steps eager where a later call would
compile again.
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

from accelab.ops import int8_gemm
from accelab.ops.decode_attention import available as decode_attention_missing, decode_attention
from accelab.serve.engines.base import SamplingParams, StepInput
from accelab.serve.runner.kv_cache import PagedKVCache
from accelab.serve.runner.llama_stack import LlamaStack, decoder_of, int8_operator, int8_rows

log = logging.getLogger(__name__)

# inductor's settings while the step compiles: weights as constants (packed for oneDNN), C++
# kernel calls. Set on its config: given as torch.compile's `options` they did not take effect
# here (compiled in half the time, to a step no faster than eager: 26.7 against 19.6 ms).
OPTIONS = {"freezing": True, "cpp_wrapper": True}
MIN_SIZE = 2  # every size is padded to this at least: torch.compile specialises sizes 0 and 1
# rows x padded queries x key positions of a step's prefill chunks that the graph takes (its scores
# are that x heads x 4 bytes); a longer prompt's chunk beside many sequences runs eager
SCORES_LIMIT = 1 << 21


def why_not(model: Any) -> str | None:
    """None when the decoding step of `model`'s stack can be compiled, else why not: float
    weights, or int8 weights with one scale a row where an int8 GEMM operator runs them for the
    model's dtype (bf16: AMX, float32: AVX2; the GEMMs that read one input joined, as the step
    runs them)."""
    inner = decoder_of(model)
    gemms = [[model.get_output_embeddings()]]
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        gemms += [[attn.q_proj, attn.k_proj, attn.v_proj], [attn.o_proj], [mlp.gate_proj, mlp.up_proj], [mlp.down_proj]]
    for modules in gemms:
        rows = [int8_rows(m.weight) for m in modules]
        if all(r is None for r in rows):
            if any(type(m.weight) is not torch.nn.Parameter for m in modules):
                return "its weights are quantized other than int8 a row (the compiled step takes float or int8)"
            continue
        if any(r is None for r in rows):
            return "some of its weights are int8 and others not in one GEMM"
        dtype = inner.embed_tokens.weight.dtype
        n = sum(r[0].shape[0] for r in rows if r is not None)
        why = int8_gemm.available(n, modules[0].in_features, dtype)
        if why is None and int8_operator(dtype, n, modules[0].in_features) is None:
            why = "`accelab env` measured it slower than the float32 GEMMs here"
        if why is not None:
            return f"its weights are int8 and the int8 GEMM operator does not run them: {why}"
    return None


def check(
    forward: Callable[..., torch.Tensor],
    prompt: list[int],
    blocks: tuple[tuple[int, ...], tuple[int, ...]],
    tolerance: Callable[[torch.dtype], float],
) -> str | None:
    """None when both compiled graphs (compiled here, by their first calls) give the eager
    steps' logits, else what differed or failed: a decoding step after `prompt`, then a step of
    its next token beside a chunk of `prompt` for a second sequence. `forward(inputs,
    compiled=)` is the engine's step; the check's sequences (ids -1, -2) hold `blocks`."""
    greedy = SamplingParams(max_tokens=1, temperature=0)
    first = StepInput(seq_id=-1, start=0, tokens=tuple(prompt), sample=True, params=greedy, blocks=blocks[0])
    try:
        nxt = int(forward([first], compiled=False)[0].argmax())
        decode = [replace(first, start=len(prompt), tokens=(nxt,))]
        want, got = forward(decode, compiled=False), forward(decode)
        problem = _differ(got, want, tolerance, "a decoding step")
        if problem is None:
            beside = replace(first, seq_id=-2, tokens=tuple(prompt[: max(2, len(prompt) // 2)]), blocks=blocks[1])
            mixed = [replace(first, start=len(prompt) + 1, tokens=(int(want[0].argmax()),)), beside]
            want, got = forward(mixed, compiled=False), forward(mixed)
            problem = _differ(got, want, tolerance, "a step with a prefill chunk")
    except Exception as err:  # noqa: BLE001 - a compile that fails leaves the eager steps
        return f"compiling it failed: {type(err).__name__}: {err}"
    return problem


def _differ(got: torch.Tensor, want: torch.Tensor, tolerance: Callable[[torch.dtype], float], what: str) -> str | None:
    error = float((got.float() - want.float()).abs().max()) / (float(want.abs().max()) or 1.0)
    if error > tolerance(got.dtype):
        return f"its logits of {what} differ from the eager steps' by {error:.2%} of their scale"
    return None


class _Decode(torch.nn.Module):
    """One decoding token for each of B sequences -> their logits [B, V]: the stack's arithmetic
    written for one query a sequence, so inductor sees one graph."""

    def __init__(self, model: Any, stack: LlamaStack, block_size: int):
        super().__init__()
        inner = decoder_of(model)

        def frozen(t: torch.Tensor) -> torch.nn.Parameter:
            return torch.nn.Parameter(t.detach(), requires_grad=False)

        int8 = int8_gemm.for_dtype(inner.embed_tokens.weight.dtype)  # why_not: it runs where weights are int8
        self.int8_kernel = int8
        self.weights = torch.nn.ParameterList()  # per layer q|k|v, o, gate|up, down: float, or packed int8
        self.scales = torch.nn.ParameterList()  # int8 weights' row scales, beside them in order
        self.int8: list[bool] = []
        self.out_rows: list[int] = []  # each weight's output rows (an int8 one is packed in blocks)

        def add(modules: Sequence[torch.nn.Linear]) -> int:
            """Their weights side by side, as one weight of `weights`: its index."""
            rows = [int8_rows(m.weight) for m in modules]
            if all(r is not None for r in rows):
                assert int8 is not None
                values = torch.cat([r[0] for r in rows if r is not None])
                self.weights.append(frozen(int8.pack(values)))
                self.scales.append(frozen(int8.pad(torch.cat([r[1] for r in rows if r is not None]).float())))
            else:
                self.weights.append(frozen(torch.cat([m.weight for m in modules])))
            self.int8.append(all(r is not None for r in rows))
            self.out_rows.append(sum(m.out_features for m in modules))
            return len(self.weights) - 1

        def bias(modules: Sequence[torch.nn.Linear], dtype: torch.dtype) -> torch.nn.Parameter | None:
            if all(m.bias is None for m in modules):
                return None
            parts = [m.bias if m.bias is not None else torch.zeros(m.out_features) for m in modules]
            return frozen(torch.cat([p.to(dtype) for p in parts]))

        self.embed = frozen(inner.embed_tokens.weight)
        self.head = add([model.get_output_embeddings()])
        self.norm = frozen(stack.norm_weight)
        self.eps = stack.norm_eps
        self.heads, self.kv_heads, self.head_dim = stack.heads, stack.kv_heads, stack.head_dim
        self.kernel = (  # the C++ decoding attention
            self.embed.device.type == "cpu" and decode_attention_missing(self.embed.dtype, self.head_dim) is None
        )
        self.block_size = block_size
        self.windows = [layer.window for layer in stack.layers]
        self.scalings = [layer.scaling for layer in stack.layers]
        self.epsilons = [(layer.norm1[1], layer.norm2[1]) for layer in stack.layers]
        self.norms = torch.nn.ParameterList()
        self.biases = torch.nn.ParameterList()  # the q|k|v biases there are
        self.bias_of: list[int | None] = []  # each layer's index in `biases`
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
            self.norms.extend([frozen(layer.input_layernorm.weight), frozen(layer.post_attention_layernorm.weight)])
            first = len(self.weights)
            for modules in (qkv, [attn.o_proj], [mlp.gate_proj, mlp.up_proj], [mlp.down_proj]):
                add(modules)
            qkv_bias = bias(qkv, self.embed.dtype)
            if qkv_bias is not None and self.int8[first] and int8 is not None:
                qkv_bias = frozen(int8.pad(qkv_bias))
            self.bias_of.append(None if qkv_bias is None else len(self.biases))
            if qkv_bias is not None:
                self.biases.append(qkv_bias)

    def _mm(self, x: torch.Tensor, j: int, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x times weight j of `weights` (+ bias): oneDNN for float weights (inductor packs them),
        the int8 GEMM operator for int8 ones."""
        if not self.int8[j]:
            return F.linear(x, self.weights[j], bias)
        scales = self.scales[sum(self.int8[:j])]
        assert self.int8_kernel is not None
        return self.int8_kernel.linear(x.contiguous(), self.weights[j], scales, bias, rows=self.out_rows[j])

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
        groups = [(None, positions[:, None], tables)]
        h = self._layers(ids, cos, sin, slots, keys, values, groups, None)
        return self._mm(_rms(h, self.norm, self.eps), self.head)

    def _where(self, tables: torch.Tensor) -> torch.Tensor:
        """Block tables [B, N] -> each sequence's KV slots [B, N * block_size], position order."""
        offsets = torch.arange(self.block_size, device=tables.device)
        return (tables[:, :, None] * self.block_size + offsets).reshape(tables.shape[0], -1)

    def _layers(
        self,
        ids: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        groups: Sequence[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]],
        back: torch.Tensor | None,
    ) -> torch.Tensor:
        """The hidden states [T, H] after every layer. `groups`: sequences attended together, as
        (rows [B, Q] of their queries in T, or None: all T tokens, one each; the queries'
        positions [B, Q]; block tables [B, N]); `back`: each token's row in the groups' outputs
        side by side (None: one group, in order). A group of one query a sequence runs the
        decoding attention kernel where it loaded (`decode_attention`)."""
        t, hq, hkv, d = ids.shape[0], self.heads, self.kv_heads, self.head_dim
        half = d // 2
        masks: dict[tuple[int, int | None], torch.Tensor] = {}
        wheres = [None if self.kernel and q_pos.shape[1] == 1 else self._where(tables) for _, q_pos, tables in groups]
        h = F.embedding(ids, self.embed)
        for i, window in enumerate(self.windows):
            w = 1 + 4 * i  # this layer's q|k|v in `weights` (the head is 0)
            eps1, eps2 = self.epsilons[i]
            at = self.bias_of[i]
            bias = None if at is None else self.biases[at]
            qkv = self._mm(_rms(h, self.norms[2 * i], eps1), w, bias)
            qk = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d)
            qk = qk * cos + qk.roll(half, dims=-1) * sin
            q, k = qk[:, :hq], qk[:, hq:]
            v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
            flat_k, flat_v = keys[i].view(-1, hkv, d), values[i].view(-1, hkv, d)
            flat_k.index_copy_(0, slots, k)
            flat_v.index_copy_(0, slots, v)
            outs = []
            scaling = self.scalings[i]
            for g, ((rows, q_pos, tables), where) in enumerate(zip(groups, wheres)):
                queries = q[:, None] if rows is None else q[rows]  # [B, Q, hq, d]
                if where is None:
                    out = decode_attention(queries[:, 0], keys[i], values[i], tables, q_pos[:, 0], scaling, window)
                    outs.append(out.view(-1, hq * d))
                    continue
                mask = masks.get((g, window))
                if mask is None:
                    mask = masks[g, window] = _mask(q_pos, where.shape[1], window)
                outs.append(_attend(queries, flat_k, flat_v, where, mask, scaling, hkv))
            attn = outs[0] if back is None else torch.cat(outs)[back]
            h = h + self._mm(attn.to(h.dtype), w + 1)
            gate_up = self._mm(_rms(h, self.norms[2 * i + 1], eps2), w + 2)
            inter = gate_up.shape[1] // 2
            h = h + self._mm(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w + 3)
        return h


class _Mixed(torch.nn.Module):
    """A step with prefill chunks -> the logits of its sampled tokens [S, V]: the decoding
    sequences attended as one group (one query each), the chunks as another (queries padded to
    the longest chunk), as the eager stack groups them. Runs `base`'s layers (its parameters)."""

    def __init__(self, base: _Decode):
        super().__init__()
        self.base = base

    def forward(
        self,
        ids: torch.Tensor,  # [T] the step's tokens, packed
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,
        slots: torch.Tensor,  # [T]
        d_rows: torch.Tensor,  # [Bd] the decoding tokens' rows in T
        d_pos: torch.Tensor,  # [Bd] their positions
        d_tables: torch.Tensor,  # [Bd, Nd]
        p_rows: torch.Tensor,  # [Bp, Q] the chunks' tokens in T (padding repeats one)
        p_pos: torch.Tensor,  # [Bp, Q]
        p_tables: torch.Tensor,  # [Bp, Np]
        back: torch.Tensor,  # [T] each token's row in the two groups' outputs [Bd + Bp * Q]
        keep: torch.Tensor,  # [S] the tokens whose logits are wanted
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
    ) -> torch.Tensor:
        base = self.base
        groups = [(d_rows[:, None], d_pos[:, None], d_tables), (p_rows, p_pos, p_tables)]
        h = base._layers(ids, cos, sin, slots, keys, values, groups, back)
        return base._mm(_rms(h[keep], base.norm, base.eps), base.head)


def _mask(q_pos: torch.Tensor, length: int, window: int | None) -> torch.Tensor:
    """Queries at q_pos [B, Q] over key positions 0..length-1 -> [B, 1, 1, Q, L] (True: seen)."""
    seen = torch.arange(length, device=q_pos.device)[None, None]
    mask = seen <= q_pos[:, :, None]
    if window:
        mask = mask & (seen > q_pos[:, :, None] - window)
    return mask[:, None, None]


def _attend(
    q: torch.Tensor,
    flat_k: torch.Tensor,
    flat_v: torch.Tensor,
    where: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    kv_heads: int,
) -> torch.Tensor:
    """Queries [B, Q, hq, d] over the KV at `where` [B, L] -> [B * Q, hq * d] (float32): query
    head j * group + g reads KV head j. Several queries a sequence (prefill chunks): the keys and
    values gathered once, then torch's fused attention (a step of 15 decodes beside a 43-token
    chunk: 34.2 against 37.0 ms with two float32 matmuls). One query a sequence, where the
    decoding kernel did not load: float32 scores and softmax over gathered copies."""
    b, width, hq, d = q.shape
    length, group = where.shape[1], hq // kv_heads
    if width > 1:
        keys, values = flat_k[where].transpose(1, 2), flat_v[where].transpose(1, 2)  # [B, KVH, L, D]
        seen, queries = mask.view(b, 1, width, length), q.transpose(1, 2)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=seen, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).float().reshape(b * width, hq * d)
    seq_k = flat_k[where].float().permute(0, 2, 3, 1)  # [B, KVH, D, L]
    seq_v = flat_v[where].float().transpose(1, 2)  # [B, KVH, L, D]
    queries = q.float().view(b, width, kv_heads, group, d).permute(0, 2, 3, 1, 4).reshape(b, kv_heads, -1, d)
    scores = (queries @ seq_k).view(b, kv_heads, group, width, length) * scaling
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).view(b, kv_heads, -1, length)
    out = (probs @ seq_v).view(b, kv_heads, group, width, d).permute(0, 3, 1, 2, 4)  # [B, Q, KVH, G, D]
    return out.reshape(b * width, hq * d)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The stack's RMSNorm (transformers' arithmetic: float32, then the weight in x's dtype)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class CompiledDecode:
    """`logits(inputs, layout, cache)` for a step `takes` accepts: a decoding step, or one with
    prefill chunks whose attention stays small. Once compiled, a call that would compile again
    raises torch._dynamo.exc.RecompileError before anything is written: the engine then steps
    eager."""

    def __init__(self, model: Any, stack: LlamaStack, block_size: int, mode: str):
        self._stack = stack
        self._module = _Decode(model, stack, block_size).eval()
        self._options = dict(OPTIONS, max_autotune=mode.startswith("max-autotune"))
        self._graphs = {"decode": torch.compile(self._module), "mixed": torch.compile(_Mixed(self._module).eval())}
        self._compiled: set[str] = set()
        self.steps = 0  # steps it ran
        self.block_size = block_size

    def takes(self, inputs: Sequence[Any]) -> str | None:
        """ "decode" (every input decodes one token), "mixed" (text chunks whose padded attention
        is at most SCORES_LIMIT rows x queries x keys) or None (the eager stack runs it)."""
        if any(item.images for item in inputs):
            return None
        if all(len(item.tokens) == 1 and item.sample for item in inputs):
            return "decode"
        chunks = [item for item in inputs if len(item.tokens) > 1]
        if not chunks or sum(len(item.tokens) for item in inputs) < MIN_SIZE:
            return None
        width = max(len(item.tokens) for item in chunks)
        longest = max(item.start + len(item.tokens) for item in chunks)
        return "mixed" if max(len(chunks), MIN_SIZE) * width * longest <= SCORES_LIMIT else None

    def logits(self, layout: Any, cache: PagedKVCache, kind: str) -> torch.Tensor:
        """Logits [N, V] at the last token of each input that samples, in order; `layout` is the
        step's StepLayout, `kind` what `takes` said of its inputs."""
        args = _decode_args(layout) if kind == "decode" else _mixed_args(layout)
        positions = args["positions"] if kind == "decode" else args.pop("positions")  # the mixed graph has q_pos
        cos, sin = self._stack.rotary_of(cache.keys[0].new_empty(0), positions)
        for name, tensor in (*args.items(), ("cos", cos), ("sin", sin)):
            for dim in range(min(tensor.dim(), 2) if name in DYNAMIC_2D else 1):
                torch._dynamo.mark_dynamic(tensor, dim)
        call = dict(args, cos=cos, sin=sin, keys=cache.keys, values=cache.values)
        graph = self._graphs[kind]
        if kind in self._compiled:  # never a second compile mid-serving (a minute's stall): RecompileError
            with torch._dynamo.config.patch(error_on_recompile=True):
                out = graph(**call)
        else:  # the first call compiles: every size gets a symbol of its own (no duck sizing)
            with fx_config.patch(use_duck_shape=False), inductor_config.patch(self._options):  # type: ignore[attr-defined]
                out = graph(**call)
            self._compiled.add(kind)
        self.steps += 1
        return out[: len(layout.sampled)]


DYNAMIC_2D = ("tables", "d_tables", "p_rows", "p_pos", "p_tables")  # both sizes symbolic


def _pad(t: torch.Tensor, size: int = MIN_SIZE) -> torch.Tensor:
    """`t` with its last row repeated up to `size` rows."""
    n = t.shape[0]
    return t if n >= size else t[torch.arange(size, device=t.device).clamp_(max=n - 1)]


def _pad_columns(tables: torch.Tensor) -> torch.Tensor:
    """Block tables widened to MIN_SIZE columns with block 0 (masked: past every position)."""
    return tables if tables.shape[1] >= MIN_SIZE else F.pad(tables, (0, MIN_SIZE - tables.shape[1]))


def _decode_args(layout: Any) -> dict[str, torch.Tensor]:
    device = layout.positions.device
    ids = torch.tensor(layout.ids, dtype=torch.long, device=device)
    tables = _pad_columns(_pad(layout.groups[0].tables))
    return {"ids": _pad(ids), "positions": _pad(layout.positions), "slots": _pad(layout.slots), "tables": tables}


def _mixed_args(layout: Any) -> dict[str, torch.Tensor]:
    device = layout.positions.device
    ids, keep = layout.ids, layout.sampled
    decodes = next((g for g in layout.groups if g.rows.shape[1] == 1), None)
    chunks = next(g for g in layout.groups if g.rows.shape[1] > 1)
    if decodes is None:  # no decoding sequence: the first chunk's last query stands in (its output unused)
        d_rows, d_pos, d_tables = chunks.rows[:1, -1], chunks.q_pos[:1, -1], chunks.tables[:1]
    else:
        d_rows, d_pos, d_tables = decodes.rows[:, 0], decodes.q_pos[:, 0], decodes.tables
    d_rows, d_pos, d_tables = _pad(d_rows), _pad(d_pos), _pad_columns(_pad(d_tables))
    back = torch.empty(len(ids), dtype=torch.long, device=device)
    if decodes is not None:
        back[decodes.targets] = torch.arange(len(decodes.targets), device=device)
    flat = chunks.keep if chunks.keep is not None else torch.arange(len(chunks.targets), device=device)
    back[chunks.targets] = d_rows.shape[0] + flat
    return {
        "ids": torch.tensor(ids, dtype=torch.long, device=device),
        "positions": layout.positions,
        "slots": layout.slots,
        "d_rows": d_rows,
        "d_pos": d_pos,
        "d_tables": d_tables,
        "p_rows": _pad(chunks.rows),
        "p_pos": _pad(chunks.q_pos),
        "p_tables": _pad_columns(_pad(chunks.tables)),
        "back": back,
        "keep": _pad(torch.tensor(keep or [len(ids) - 1], dtype=torch.long, device=device)),
    }
