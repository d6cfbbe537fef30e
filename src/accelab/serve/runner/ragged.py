"""Continuous-batching steps for a transformers causal LM over a paged KV cache: every step's
chunks (one decode token per running sequence, prefill chunks of new ones) are packed into ONE
sequence of T tokens and run by the model's own forward, so each Linear runs once per step on
[T, hidden], and attention runs once per layer for all the decoding sequences and once for all
the prefilling chunks (`paged_attention`).

The KV cache is the scheduler's block pool made real (`kv_cache.PagedKVCache`, allocated once:
kv_blocks x block_size positions); each StepInput carries its sequence's block table, and the
scheduler's prefix cache, preemptions and forks move block ids, never tensors (a copy-on-write
is `copy_blocks`). Two pieces plug into the model through transformers' own extension points:
the per-step cache object passed as the model's `cache` (its `update` writes the new keys and
values into their slots) and an attention function registered with `AttentionInterface`
("accelab_paged"); the model's mask builder is skipped (no mask function is registered for it).

Why not transformers' ContinuousBatchingManager: on this CPU it decoded 8 SmolLM2 sequences at
51 tok/s where the packed steps ran at ~116 (its paged path reads the whole block table through a
4D mask every step), it schedules on its own thread (the server's admission control, KV-capacity
429s, deadlines and cancellations need the step under our scheduler), and it samples with one
generation config for all requests. Shapes change every step, so the model runs eager; a plan
that compiles gets the steps compiled instead (`compiled_decode`: one graph for decoding steps,
one for steps with prefill chunks, their sizes symbolic), checked against the eager steps at
start-up.

A model whose attention does not follow this pattern (attention that reads keys after the cache
update, caches of another shape) is caught by `self_check` at start-up, which compares the
packed step's logits with the model's plain forward; the server then falls back to the
per-batch scheduler and says why.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace
from typing import Any

import torch

from accelab.catalog.facts import text_config
from accelab.plan.runtime import Unsupported, input_device
from accelab.serve.engines.base import SamplingParams, StepCost, StepInput
from accelab.serve.runner import compiled_decode, llama_stack, packed_linear
from accelab.serve.runner.compiled_decode import CompiledDecode
from accelab.serve.runner.encoder_slices import SlicedEncoder, encode_wanted
from accelab.serve.runner.kv_cache import PagedKVCache
from accelab.serve.runner.packed_linear import PackedLinears
from accelab.serve.runner.paged_attention import ATTENTION_NAME, StepCache, StepLayout, register
from accelab.serve.runner.sampling import SampledToken, sample_step
from accelab.serve.runner.vision import EncoderCache, ImageInput, VisionEncoder, image_inserts, vision_parts

log = logging.getLogger(__name__)


STACK_NAME = "packed steps over the model's layers as plain tensor operations, paged KV cache"
OWN_FORWARD_NAME = "packed steps over the model's own forward, paged KV cache (accelab_paged attention)"


def takes_weights_over(model: Any, compile_mode: str) -> bool:
    """Whether a server's steps take the model's Linear weights over as they pack them (held once):
    an eager text model's; compiled graphs and a vision-language model's steps keep a copy of their own."""
    return compile_mode == "off" and vision_parts(model) is None


class RaggedTorchEngine:
    """Steps of many sequences through one forward of a transformers causal LM, over the
    scheduler's KV blocks (see the module docstring). Owns the model's attention setting while
    it lives; `close` restores it. `limits`: the scheduler's SchedulerConfig (kv_blocks,
    block_size size the cache).

    `take_over`: the start-up check's prompt, for a server: the model's own logits for it are
    computed first, then the plain-tensor stack (eager plans of a text model) takes each layer's
    weights out of the model as it packs its own copy, so they are never held twice;
    `self_check(take_over)` compares with those logits, and a stack that differs is then an
    error, not a fallback (the model's own forward is gone)."""

    def __init__(
        self,
        runnable: Any,
        limits: Any,
        *,
        pack_linears: bool = True,
        pack_head: bool = True,
        stack: bool = True,
        take_over: list[int] | None = None,
    ):
        model = runnable.model
        config = getattr(model, "config", None)
        if config is None or not hasattr(model, "set_attn_implementation"):
            raise Unsupported(f"{type(model).__name__} is not a transformers model: continuous batching needs one")
        compile_mode = getattr(runnable.plan, "compile", "off") if runnable.plan is not None else "off"
        text = text_config(config)
        self.runnable = runnable
        self.model = model
        self.device = input_device(model, runnable.device)
        self.block_size = limits.block_size
        self.cache = PagedKVCache(
            layers=text.num_hidden_layers,
            num_blocks=limits.kv_blocks,
            block_size=limits.block_size,
            kv_heads=_kv_heads(text),
            head_dim=_head_dim(text),
            dtype=_dtype_of(model),
            device=self.device,
        )
        self.kv_bytes_per_token = self.cache.bytes_per_block // self.block_size
        self._cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._original_attention = config._attn_implementation
        self._encoder: VisionEncoder | None = None
        self.encoder_cache: EncoderCache | None = None
        self._slices: SlicedEncoder | None = None
        self._layers, self._heads = text.num_hidden_layers, text.num_attention_heads
        self._head_dim = _head_dim(text)
        self.precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(_dtype_of(model), "fp32")
        self._body_params, self._head_params, self._weight_bytes = _linear_sizes(model)
        self._pack_linears, self._pack_head = pack_linears, pack_head
        self._packed: PackedLinears | None = None
        self._head: torch.nn.Linear | None = None
        self._compiled: CompiledDecode | None = None
        self._handed_over = False  # the model's Linear weights left it for the stack's (hand_over_weights)
        self._reference: tuple[list[int], torch.Tensor] | None = None  # the check's prompt + token, their logits
        self._build(limits, stack, take_over, compile_mode)

    def _build(self, limits: Any, stack: bool, take_over: list[int] | None, compile_mode: str) -> None:
        """The steps the model gets: a vision-language model's, or a text model's (taking its
        weights over where asked), compiled where the plan compiles and the steps can be."""
        try:
            if vision_parts(self.model) is not None:
                self._vision(limits, stack)
            else:
                if take_over is not None and takes_weights_over(self.model, compile_mode) and stack:
                    self._reference = self._check_reference(take_over)
                self._text(stack, take_over=self._reference is not None)
        except BaseException:
            self.close()  # the model's own attention back: the per-batch worker runs it next
            raise
        if compile_mode != "off":
            try:
                self._compile(compile_mode)
            except Unsupported as why:  # still continuous, eager: a compile is speed, not a feature
                log.warning("the plan compiles, but the continuous steps run eager: %s", why)

    def _text(self, stack: bool, take_over: bool = False) -> None:
        model, config = self.model, self.model.config
        register()
        model.set_attn_implementation(ATTENTION_NAME)
        if config._attn_implementation != ATTENTION_NAME:  # transformers logs it and keeps its own
            raise Unsupported(
                f"{type(model).__name__}'s attention does not go through transformers' "
                "AttentionInterface, so the packed steps cannot give it the paged KV cache"
            )
        why = llama_stack.why_not(model) if stack else "not asked for"
        self._stack = llama_stack.LlamaStack(model, take_over=take_over) if why is None else None
        self._handed_over = self._stack is not None and take_over
        self.name = STACK_NAME
        if self._stack is None:
            log.info("the continuous steps run the model's own forward (%s)", why)
            self._use_model_forward()

    def _compile(self, mode: str) -> None:
        """The plan compiles: the steps run compiled (`compiled_decode`); the model's own forward,
        which the steps do not run, keeps its eager code for the start-up check."""
        stack = self._stack
        if stack is None:
            raise Unsupported("the plan compiles the model, and steps through the model's own forward cannot be")
        why = compiled_decode.why_not(self.model)
        if why is not None:
            raise Unsupported(f"the plan compiles the model, and the continuous steps cannot be compiled: {why}")
        own = getattr(self.model.forward, "_torchdynamo_orig_callable", None)
        if own is not None:
            self.model.forward = own
        self._compiled = CompiledDecode(self.model, stack, self.block_size, mode)
        self.name += ", steps compiled"

    def _vision(self, limits: Any, stack: bool) -> None:
        """A vision-language model: its language part runs as the plain-tensor stack (its own
        forward takes no paged cache with image embeddings), its vision tower encodes each image
        once (`vision.EncoderCache`, sized in feature rows by `limits.encoder_cache_rows`)."""
        why = llama_stack.why_not(self.model) if stack else "not asked for"
        if why is not None:
            raise Unsupported(f"the language part of {type(self.model).__name__} cannot run as packed steps: {why}")
        self._stack = llama_stack.LlamaStack(self.model)
        self.name = STACK_NAME + ", images encoded once per distinct image"
        self._encoder = VisionEncoder(self.model, self.device, _dtype_of(self.model))
        self.encoder_cache = EncoderCache(max_rows=getattr(limits, "encoder_cache_rows", 0) or 4096)
        layers = self._encoder.layers
        self._slices = SlicedEncoder(self._encoder, layers, self.runnable.context) if layers else None

    def _use_model_forward(self) -> None:
        """Steps through the model's own forward, its Linear layers packed for oneDNN where they can be."""
        self._stack = None
        self._compiled = None
        self.name = OWN_FORWARD_NAME
        model = self.model
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self._packed = (
            PackedLinears(model, skip=() if self._pack_head or head is None else (head,))
            if self._pack_linears and packed_linear.available(self.device, _dtype_of(model))
            else None
        )
        self._head = None if self._pack_head and self._packed else _transposed_head(model)

    # -- the step -------------------------------------------------------------------------
    def step(self, inputs: list[StepInput]) -> list[SampledToken]:
        logits = self._forward(inputs)  # [N, V]: the rows of the inputs that sample, in order
        return sample_step(logits, [item for item in inputs if item.sample])

    def _forward(self, inputs: list[StepInput], compiled: bool = True) -> torch.Tensor:
        """Logits [N, V] at the last token of each input that samples."""
        with torch.inference_mode():  # its tensors as the step's: a compiled graph guards on the kind
            layout = StepLayout(inputs, self.block_size, self.device)
        kind = self._compiled.takes(inputs) if compiled and self._compiled is not None else None
        if kind is not None:
            assert self._compiled is not None
            try:
                with torch.inference_mode(), self.runnable.context():
                    return self._compiled.logits(layout, self.cache, kind)
            except torch._dynamo.exc.RecompileError as err:
                self._drop_compiled(f"it would compile again: {str(err).splitlines()[-1].strip()}")
        ids, keep = layout.ids, layout.sampled
        device = self.device
        if self._stack is not None:
            with torch.inference_mode(), self.runnable.context():
                ids_t = torch.tensor(ids, dtype=torch.long, device=device)
                rows = torch.tensor(keep or [len(ids) - 1], dtype=torch.long, device=device)
                inserts = self._image_embeddings(inputs)
                return self._stack.logits(ids_t, layout, self.cache, rows, inserts)[: len(keep)]
        batch = {
            "input_ids": torch.tensor([ids], dtype=torch.long, device=device),  # [1, T]
            "position_ids": layout.positions[None],  # [1, T]
            self._cache_kwarg: StepCache(self.cache, layout),
            "use_cache": True,
            "logits_to_keep": torch.tensor(keep or [len(ids) - 1], dtype=torch.long, device=device),
        }
        with torch.inference_mode(), self.runnable.context():
            logits = self.model(**batch).logits[0]  # [N, V]
        return logits[: len(keep)]

    def _image_embeddings(self, inputs: list[StepInput]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's image rows and their features (`vision.image_inserts`), for a VLM."""
        if self._encoder is None:
            return None
        assert self.encoder_cache is not None
        return image_inserts(inputs, self.encoder_cache, self._encoder, self.device)

    # -- images encoded between the steps ---------------------------------------------------------
    @property
    def encodes_ahead(self) -> bool:
        """Images are encoded between the steps, in slices (`encode_ahead`)."""
        return self._slices is not None

    def image_ready(self, key: Hashable) -> bool:
        """The features of the image with this key are in the encoder cache."""
        return self.encoder_cache is not None and key in self.encoder_cache

    def encode_ahead(
        self,
        wanted: Sequence[tuple[int, ImageInput]],
        budget_s: float | None,
        *,
        batch: int = 1,
        interrupt: Callable[[], bool] | None = None,
    ) -> dict[str, BaseException]:
        """Encode the images the prefill waits for, for about `budget_s` seconds, up to `batch` in
        one forward, pausing early once `interrupt()`, into the encoder cache
        (`encoder_slices.encode_wanted`); returns the errors of those that failed, by key."""
        slices, cache = self._slices, self.encoder_cache
        assert slices is not None and cache is not None, "a vision-language model's engine encodes ahead"
        return encode_wanted(slices, cache, wanted, budget_s, batch=batch, interrupt=interrupt)

    def step_cost(self, inputs: Sequence[Any]) -> StepCost:
        """What a step of these chunks (anything with start, tokens, sample) must read and compute:
        every Linear weight once and each sequence's KV once; 2 FLOPs per multiply-add of the
        Linear layers over the step's tokens (the output layer over the sampled rows only) and of
        attention (q.k and p.v over each token's positions)."""
        tokens = sampled = positions = seen = 0
        for item in inputs:
            n = len(item.tokens)
            tokens += n
            sampled += bool(item.sample)
            positions += item.start + n  # KV read once per sequence
            seen += n * item.start + n * (n + 1) // 2  # positions each token attends to
        flops = 2 * (self._body_params * tokens + self._head_params * sampled)
        flops += 4 * self._layers * self._heads * self._head_dim * seen
        return StepCost(bytes_read=self._weight_bytes + self.kv_bytes_per_token * positions, flops=flops)

    def copy_blocks(self, copies: Sequence[Any]) -> None:
        """Copy-on-write the scheduler asked for (Step.copies), before the step's chunks run."""
        with torch.inference_mode():
            self.cache.copy_blocks(copies)

    def fork(self, parent_seq_id: int, child_seq_id: int, n_tokens: int) -> None:
        """Nothing to copy: the scheduler's `fork` shares the parent's blocks with the child."""

    def score(self, tokens: Sequence[int]) -> torch.Tensor:
        """Logits [len(tokens), V] of every position (prompt logprobs): the model's own forward,
        or, once the model's weights were handed over, the stack over a scratch cache of its own."""
        if not self._handed_over:
            return self._reference_logits(list(tokens))
        assert self._stack is not None
        blocks = -(-len(tokens) // self.block_size)
        scratch = PagedKVCache(
            layers=self.cache.layers,
            num_blocks=blocks,
            block_size=self.block_size,
            kv_heads=self.cache.kv_heads,
            head_dim=self.cache.head_dim,
            dtype=self.cache.keys[0].dtype,
            device=self.device,
            announce=False,
        )
        item = StepInput(
            seq_id=-1,
            start=0,
            tokens=tuple(tokens),
            sample=True,
            params=SamplingParams(max_tokens=1),
            blocks=tuple(range(blocks)),
        )
        with torch.inference_mode(), self.runnable.context():
            layout = StepLayout([item], self.block_size, self.device)
            every = torch.arange(len(tokens), device=self.device)
            return self._stack.logits(torch.tensor(layout.ids, device=self.device), layout, scratch, every)

    def _check_reference(self, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
        """The model's own logits for the check's prompt and its greedy next token (taken before
        the stack takes the weights over)."""
        first = self._reference_logits(prompt)
        ids = [*prompt, int(first[-1].argmax())]
        return ids, self._reference_logits(ids)

    @property
    def handed_over(self) -> int:
        """Bytes of the model's weights the steps took over (0: none; the model's own forward runs)."""
        return self._stack.released if self._stack is not None and self._handed_over else 0

    def hand_over_weights(self) -> int:
        """After the start-up check, for a server whose steps run the plain-tensor stack: the
        model's Linear weights, which the stack holds in its own layout (packed for oneDNN or the
        int8 operator), leave the model, so they are held once (an 8B's int8 weights were held
        twice); prompt scoring moves to the stack. Returns the bytes released (0: nothing to hand
        over: the steps run the model's own forward, or a vision tower needs it)."""
        if self._stack is None or self._encoder is not None:
            return 0
        released = self._stack.release_model_weights()
        self._handed_over = True
        return released

    def release(self, seq_id: int) -> None:
        """Its blocks go back to the pool in the scheduler; here its hold on image features ends."""
        if self.encoder_cache is not None:
            self.encoder_cache.release(seq_id)

    def close(self) -> None:
        self.cache = None  # type: ignore[assignment]  # closed: the KV memory goes now, not with the engine
        if self._packed is not None:
            self._packed.unpack()
        if self._slices is not None:
            self._slices.close()
        if self._encoder is not None:
            self._encoder.close()
        if self._head is not None:
            with contextlib.suppress(AttributeError):
                del self._head.forward  # back to the class's forward
        if self._encoder is None:  # a vision-language model's attention setting was never changed
            with contextlib.suppress(Exception):
                self.model.set_attn_implementation(self._original_attention)

    # -- start-up check -----------------------------------------------------------------------
    def self_check(
        self, prompt: list[int], images: tuple[ImageInput, ...] = (), reference: dict[str, Any] | None = None
    ) -> str | None:
        """None when the packed steps give the model's own logits for `prompt` (fed in two
        chunks, the second beside another sequence's prefill, then one decode step), else what
        differed. Uses the pool's last blocks: nothing else runs yet. When the plain-tensor
        stack differs, the steps go through the model's own forward and that is checked. A
        vision-language model's check feeds `images` (the prompt's), its reference forward takes
        `reference` (the processor's pixel tensors) beside the ids."""
        problem = self._check(prompt, images, reference)
        if self.encoder_cache is not None:  # the check's picture is no request's: counts start at zero
            self.encoder_cache = EncoderCache(max_rows=self.encoder_cache.max_rows)
        if problem is not None and self._stack is not None and self._encoder is None and not self._handed_over:
            log.warning(
                "the plain-tensor layers of %s do not reproduce its own forward (%s); running its own forward",
                type(self.model).__name__,
                problem,
            )
            self._use_model_forward()
            problem = self._check(prompt)
        if problem is None and self._compiled is not None:
            self._check_compiled(prompt)
        return problem

    def _check_compiled(self, prompt: list[int]) -> None:
        """Compile both graphs (their first calls) against the eager stack; on a difference or a
        failure the steps stay eager."""
        count, started = self.cache.num_blocks, time.perf_counter()
        need = -(-(len(prompt) + 2) // self.block_size)
        blocks = tuple(range(count - 1, count - 1 - need, -1)), tuple(range(count - 1 - need, count - 1 - 2 * need, -1))
        try:
            problem = compiled_decode.check(self._forward, prompt, blocks, _tolerance)
        finally:
            self.release(-1)
            self.release(-2)
        if problem is None:
            log.info("the steps compiled in %.1f s and give the eager steps' logits", time.perf_counter() - started)
        else:
            self._drop_compiled(problem)

    def _drop_compiled(self, why: str) -> None:
        log.warning("the compiled steps are not used (%s); the steps run eager", why)
        self._compiled = None
        self.name = self.name.replace(", steps compiled", "")

    def _check(
        self, prompt: list[int], images: tuple[ImageInput, ...] = (), reference: dict[str, Any] | None = None
    ) -> str | None:
        if len(prompt) < 3:
            raise ValueError("self_check needs a prompt of 3 tokens or more")
        greedy = SamplingParams(max_tokens=1, temperature=0)
        size, count = self.block_size, self.cache.num_blocks
        need = -(-max(len(prompt) + 1, 6) // size)
        if 2 * need > count:
            return f"the KV cache ({count} blocks of {size}) cannot hold the start-up check's {len(prompt) + 1} tokens"
        mine = tuple(range(count - need, count))[::-1]  # not in order: the tables must be followed
        other = tuple(range(count - 2 * need, count - need))
        cut = len(prompt) // 2
        first = StepInput(
            seq_id=-1, start=0, tokens=tuple(prompt[:cut]), sample=False, params=greedy, blocks=mine, images=images
        )
        try:
            self._forward([first], compiled=False)
            second = replace(first, start=cut, tokens=tuple(prompt[cut:]), sample=True)
            beside = replace(first, seq_id=-2, start=0, tokens=tuple(prompt[:3]), sample=True, blocks=other)
            packed = self._forward([second, beside], compiled=False)[0]
            stored = self._reference if self._reference is not None and self._reference[0][:-1] == prompt else None
            nxt = stored[0][-1] if stored is not None else int(packed.argmax())
            decoded = self._forward(
                [
                    replace(first, start=len(prompt), tokens=(nxt,), sample=True),
                    replace(beside, start=3, tokens=tuple(prompt[3:6]), sample=False),
                ],
                compiled=False,
            )[0]
        except Exception as err:  # noqa: BLE001 - any failure means: not this model
            return f"the packed step failed: {type(err).__name__}: {err}"
        finally:
            self.release(-1)
            self.release(-2)
        if stored is None and self._handed_over:
            return "the model's own logits are known only for the prompt its weights were taken over with"
        reference_logits = stored[1] if stored is not None else self._reference_logits(prompt + [nxt], reference)
        for got, want, where in (
            (packed, reference_logits[-2], "after the prompt"),
            (decoded, reference_logits[-1], "one step on"),
        ):
            scale = float(want.abs().max()) or 1.0
            error = float((got.float() - want.float()).abs().max()) / scale
            if error > _tolerance(got.dtype):
                return f"its logits {where} differ from the model's own forward by {error:.2%} of their scale"
        return None

    def _reference_logits(self, ids: list[int], extra: dict[str, Any] | None = None) -> torch.Tensor:
        """The model's own forward over `ids` (with `extra` inputs: a VLM's pixel tensors)."""
        attention = self.model.config._attn_implementation
        if self._encoder is None:
            self.model.set_attn_implementation(self._original_attention)
        suspended = self._packed.suspended() if self._packed is not None else contextlib.nullcontext()
        own_encoder = self._encoder.reference() if self._encoder is not None else contextlib.nullcontext()
        try:
            with suspended, own_encoder, torch.inference_mode(), self.runnable.context():
                batch = torch.tensor([ids], dtype=torch.long, device=self.device)
                more = {k: v.to(self.device) for k, v in (extra or {}).items()}
                return self.model(input_ids=batch, use_cache=False, **more).logits[0]
        finally:
            if self._encoder is None:
                self.model.set_attn_implementation(attention)


def _transposed_head(model: Any) -> torch.nn.Linear | None:
    """Compute the output layer as (W @ h^T)^T: the vocabulary-sized GEMM with a few rows of h
    (one per sampled sequence) ran 2.4x faster that way than as F.linear on this project's CPUs
    (MKL: 49152x576 fp32 weight, 8 rows: 5.6 ms against 13.3 ms; 1 row: the same). Only for a
    plain Linear with a float weight and no bias; anything else keeps its own forward."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear or head.bias is not None or type(head.weight) is not torch.nn.Parameter:
        return None
    weight = head.weight

    def forward(hidden: torch.Tensor) -> torch.Tensor:  # hidden: [..., H] -> [..., V]
        flat = hidden.reshape(-1, hidden.shape[-1])
        return torch.mm(weight, flat.t()).t().reshape(*hidden.shape[:-1], weight.shape[0])

    head.forward = forward
    return head


def _linear_sizes(model: Any) -> tuple[int, int, int]:
    """(parameters of the Linear layers but the output layer, the output layer's, the bytes of both)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    body = params = nbytes = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            count = module.weight.numel()
            params += count
            int8 = llama_stack.int8_rows(module.weight)
            nbytes += count * module.weight.element_size() if int8 is None else count + int8[1].numel() * 4
            body += 0 if module is head else count
    return body, params - body, nbytes


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-3 if dtype == torch.float32 else 5e-2


def _dtype_of(model: Any) -> torch.dtype:
    try:
        return next(p.dtype for p in model.parameters() if p.is_floating_point())
    except StopIteration:
        return torch.float32


def _kv_heads(text_config: Any) -> int:
    return getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads


def _head_dim(text_config: Any) -> int:
    return getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
