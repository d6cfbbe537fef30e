"""The paged continuous steps on tiny random models of the architectures users bring: every
request's greedy tokens, packed beside others (chunked prefill, prefix-cache hits, a
preemption, a fork), equal transformers' own `generate` for that request alone. Architectures
the steps cannot reproduce are refused with the reason, so the server falls back."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from fake_clock import FakeClock

from accelab.plan.runtime import Runnable, Unsupported
from accelab.serve.engines.base import SamplingParams, StepInput
from accelab.serve.runner.ragged import RaggedTorchEngine
from accelab.serve.scheduler import Scheduler, SchedulerConfig
from accelab.serve.stops import StopRules

pytestmark = pytest.mark.cpu_kind  # its path depends on the CPU (make test-avx2)

VOCAB = 384
# initializer_range 0.2: peaked logits, so greedy picks are not near-ties that rounding could flip
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
)
ARCHITECTURES = {
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, {}),
    "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, {}),
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, {"head_dim": 16}),
    "mistral (sliding window 8)": (T.MistralConfig, T.MistralForCausalLM, {"sliding_window": 8}),
    "gemma2 (soft-capping, sliding)": (T.Gemma2Config, T.Gemma2ForCausalLM, {"head_dim": 16, "sliding_window": 8}),
    "gemma3 (sliding and full layers)": (
        T.Gemma3TextConfig,
        T.Gemma3ForCausalLM,
        {"head_dim": 16, "sliding_window": 8, "sliding_window_pattern": 2},
    ),
    "phi3": (T.Phi3Config, T.Phi3ForCausalLM, {"pad_token_id": 0}),
    "olmo2": (T.Olmo2Config, T.Olmo2ForCausalLM, {}),
    "granite": (
        T.GraniteConfig,
        T.GraniteForCausalLM,
        {"logits_scaling": 2.0, "attention_multiplier": 0.3, "residual_multiplier": 0.5, "embedding_multiplier": 3.0},
    ),
    "qwen2-moe": (
        T.Qwen2MoeConfig,
        T.Qwen2MoeForCausalLM,
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
        },
    ),
    "mixtral (moe)": (T.MixtralConfig, T.MixtralForCausalLM, {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "gpt-oss (moe, attention sinks)": (
        T.GptOssConfig,
        T.GptOssForCausalLM,
        {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8},
    ),
}


def tiny(config_class, model_class, extra):
    torch.manual_seed(0)
    return model_class(config_class(**{**COMMON, **extra})).eval()


def runnable(model) -> Runnable:
    return Runnable(model=model, processor=None, device=torch.device("cpu"), task="text-generation")


def requests() -> list[tuple[list[int], int]]:
    """Prompts that share a 9-token head (two whole blocks of 4: prefix-cache hits), of other lengths."""
    g = torch.Generator().manual_seed(1)
    head = torch.randint(3, VOCAB, (9,), generator=g).tolist()
    return [
        (head + torch.randint(3, VOCAB, (n,), generator=g).tolist(), new)
        for n, new in ((2, 10), (7, 6), (0, 12), (12, 8), (5, 9))
    ]


def alone(model, prompt: list[int], new: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[0, len(prompt) :].tolist()


def serve(engine: RaggedTorchEngine, limits: SchedulerConfig, reqs, *, fork_first: bool = False):
    """The continuous worker's loop, single-threaded: schedule, copy-on-write, step, advance."""
    sched = Scheduler(limits, FakeClock())
    greedy = SamplingParams(max_tokens=64, temperature=0)
    seqs = [sched.add(i, tuple(p), stops=StopRules(max_tokens=n)) for i, (p, n) in enumerate(reqs)]
    copies = 0
    while not sched.idle:
        step = sched.schedule()
        engine.copy_blocks(step.copies)
        copies += len(step.copies)
        inputs = [
            StepInput(
                seq_id=c.seq.id,
                start=c.start,
                tokens=c.tokens,
                sample=c.sample,
                params=greedy,
                blocks=tuple(c.seq.block_table),
            )
            for c in step.chunks
        ]
        picked = iter(engine.step(inputs))
        for chunk in step.chunks:
            ends = sched.advance(chunk, next(picked).token if chunk.sample else None)
            seq = chunk.seq
            if ends is not None:  # the scheduler's verdict: max_tokens reached
                sched.finish(seq)
            elif fork_first and seq is seqs[0] and len(seq.generated) == 1:  # n = 2: a second greedy choice
                seqs.append(sched.fork(seq, "choice 2"))
                fork_first = False
    return [s.generated for s in seqs], sched, copies


STACKED = {"llama", "qwen2", "mistral (sliding window 8)"}  # run as plain tensor operations (llama_stack)


@pytest.mark.parametrize(
    ("name", "stack"), [(name, True) for name in ARCHITECTURES] + [(name, False) for name in sorted(STACKED)]
)
def test_packed_greedy_tokens_equal_generate_alone(name, stack):
    """Every architecture through the steps it gets; the stacked ones through the model's own
    forward too (what they fall back to)."""
    model = tiny(*ARCHITECTURES[name])
    reqs = requests()
    want = [alone(model, p, n) for p, n in reqs]
    # 3 running at once, 12 tokens a step (chunked prefill), 12 blocks of 4: preemptions on the way
    limits = SchedulerConfig(max_running=3, max_step_tokens=12, kv_blocks=12, block_size=4, prefix_caching=True)
    engine = RaggedTorchEngine(runnable(model), limits, stack=stack)
    assert ("plain tensor operations" in engine.name) == (stack and name in STACKED), engine.name
    try:
        assert engine.self_check(reqs[1][0]) is None
        got, sched, copies = serve(engine, limits, reqs, fork_first=True)
    finally:
        engine.close()
    assert got[:5] == want
    assert got[5] == want[0][: len(got[5])] and len(got[5]) == reqs[0][1]  # the fork: the same greedy answer
    assert sched.pool.hits >= 4 and sched.preemptions >= 1 and copies >= 1
    assert sched.used_blocks == 0


def test_a_stack_that_differs_from_the_model_falls_back_to_its_own_forward(monkeypatch, caplog):
    """A fault put into the plain-tensor layers (RMSNorm off by 1%) is caught by the start-up
    check, which then runs and checks the model's own forward instead."""
    from accelab.serve.runner import llama_stack

    rms = llama_stack._rms
    monkeypatch.setattr(llama_stack, "_rms", lambda x, w, eps: rms(x, w, eps) * 1.01)
    model = tiny(*ARCHITECTURES["llama"])
    engine = RaggedTorchEngine(runnable(model), SchedulerConfig(max_running=2, kv_blocks=16, block_size=4))
    try:
        assert "plain tensor operations" in engine.name
        with caplog.at_level("WARNING"):
            assert engine.self_check(list(range(5, 25))) is None
        assert "the model's own forward" in engine.name
        assert "do not reproduce its own forward (its logits after the prompt differ" in caplog.text
    finally:
        engine.close()


def test_latent_attention_is_refused_with_the_reason():
    model = tiny(
        T.DeepseekV3Config,
        T.DeepseekV3ForCausalLM,
        {
            "kv_lora_rank": 16,
            "q_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 16,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
        },
    )
    engine = RaggedTorchEngine(runnable(model), SchedulerConfig(max_running=2, kv_blocks=16, block_size=4))
    try:
        problem = engine.self_check(list(range(5, 25)))
    finally:
        engine.close()
    assert problem is not None and "latent attention" in problem
    assert "the model caches keys of (1, 16) and values of (1, 8) per token; the paged cache holds (2, 8)" in problem


def test_attention_outside_the_attention_interface_is_refused_with_the_reason():
    torch.manual_seed(0)
    # Bloom computes its ALiBi attention in its own module (Falcon did too until transformers 5.25
    # moved it onto the AttentionInterface)
    model = T.BloomForCausalLM(T.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4)).eval()
    with pytest.raises(
        Unsupported, match="BloomForCausalLM's attention does not go through transformers' AttentionInterface"
    ):
        RaggedTorchEngine(runnable(model), SchedulerConfig(max_running=2, kv_blocks=16, block_size=4))


@pytest.mark.parametrize("name", sorted(STACKED))
@pytest.mark.parametrize("stack", [True, False], ids=["stack", "own-forward"])
def test_bf16_steps_give_the_models_own_logits_within_bf16s_tolerance(name, stack, monkeypatch):
    """bf16 weights, activations and KV cache (oneDNN bf16 GEMMs where the CPU has them, the
    grouped bf16 attention), packed beside other sequences with chunked prefill, prefix hits and
    preemptions: at every sampled row the logits are the model's own bf16 forward over that
    sequence's tokens so far, within the tolerance the start-up check holds bf16 to. (Greedy
    tokens are not compared with generate's: bf16 rounds differently in other kernels, so a
    near-tie may flip; fp32 is held to exact tokens above.)"""
    from accelab.serve.runner import packed_linear, paged_attention, ragged

    monkeypatch.setattr(paged_attention, "SMALL_ATTENTION", 0)  # these tiny steps would all take fp32 SDPA
    model = tiny(*ARCHITECTURES[name]).to(torch.bfloat16)
    limits = SchedulerConfig(max_running=3, max_step_tokens=12, kv_blocks=12, block_size=4, prefix_caching=True)
    engine = RaggedTorchEngine(runnable(model), limits, stack=stack)
    prompts = [p for p, _ in requests()]
    history: dict[int, list[int]] = {}
    errors: list[float] = []
    forward = engine._forward

    def checked(inputs):
        logits = forward(inputs)
        for item in inputs:  # a prefix-cache hit starts past the prompt's head: the prompt has it
            known = history.get(item.seq_id, prompts[item.seq_id])
            history[item.seq_id] = known[: item.start] + list(item.tokens)
        for got, item in zip(logits, [i for i in inputs if i.sample]):
            want = engine._reference_logits(history[item.seq_id])[-1].float()
            errors.append(float((got.float() - want).abs().max()) / float(want.abs().max()))
        return logits

    try:
        assert engine.cache.keys[0].dtype == torch.bfloat16 and engine.precision == "bf16"
        assert engine.self_check(requests()[1][0]) is None
        assert ("plain tensor operations" in engine.name) == stack
        if not stack:  # the own-forward path packs the Linear layers where oneDNN computes bf16
            packed = "forward" in vars(model.model.layers[0].mlp.up_proj)
            assert packed == packed_linear.available(torch.device("cpu"), torch.bfloat16)
        engine._forward = checked
        got, sched, _ = serve(engine, limits, requests())
    finally:
        engine.close()
    assert [len(tokens) for tokens in got[:5]] == [n for _, n in requests()]
    assert sched.preemptions >= 1 and sched.used_blocks == 0
    assert len(errors) >= sum(n for _, n in requests())
    assert max(errors) <= ragged._tolerance(torch.bfloat16), max(errors)


def test_the_start_up_check_of_bf16_steps_catches_a_fault_within_bf16s_tolerance(monkeypatch, caplog):
    """An error that bf16 rounding would never make (RMSNorm off by 10%) fails the bf16 check: the
    steps fall back to the model's own forward, which passes."""
    from accelab.serve.runner import llama_stack

    rms = llama_stack._rms
    monkeypatch.setattr(llama_stack, "_rms", lambda x, w, eps: rms(x, w, eps) * 1.1)
    model = tiny(*ARCHITECTURES["llama"]).to(torch.bfloat16)
    engine = RaggedTorchEngine(runnable(model), SchedulerConfig(max_running=2, kv_blocks=16, block_size=4))
    try:
        with caplog.at_level("WARNING"):
            assert engine.self_check(list(range(5, 25))) is None
        assert "the model's own forward" in engine.name
        assert "do not reproduce its own forward" in caplog.text
    finally:
        engine.close()


def test_int8_weights_run_torchs_int8_kernel_and_give_the_models_own_logits():
    """int8 weights (torchao's int8 weight-only, per row) with bf16 activations: the stack takes
    the int8 values and scales as they are into torch's int8 x bf16 kernel, and its logits are the
    model's own forward (torchao's) within bf16's tolerance; the output layer stays bf16."""
    from torchao.quantization import quantize_

    from accelab.plan.techniques.quantization import head_modules, layer_filter, make_config
    from accelab.serve.runner import llama_stack, ragged

    model = tiny(*ARCHITECTURES["llama"]).to(torch.bfloat16)
    quantize_(
        model,
        make_config("int8-weight", torch.device("cpu")),
        filter_fn=layer_filter("int8-weight", head_modules(model)),
    )
    assert llama_stack.int8_rows(model.model.layers[0].mlp.up_proj.weight) is not None
    limits = SchedulerConfig(max_running=3, max_step_tokens=12, kv_blocks=12, block_size=4, prefix_caching=True)
    engine = RaggedTorchEngine(runnable(model), limits)
    try:
        assert "plain tensor operations" in engine.name
        assert engine.self_check(requests()[1][0]) is None
        prompt = requests()[3][0]
        greedy = SamplingParams(max_tokens=1, temperature=0)
        item = StepInput(seq_id=0, start=0, tokens=tuple(prompt), sample=True, params=greedy, blocks=(0, 1, 2, 3, 4, 5))
        got = engine._forward([item])[0].float()
        want = engine._reference_logits(prompt)[-1].float()
        assert float((got - want).abs().max()) / float(want.abs().max()) <= ragged._tolerance(torch.bfloat16)
        # what a step must read: int8 body weights (1 byte each, and a float scale per row), bf16 output layer
        body, head = engine._body_params, engine._head_params
        rows = sum(m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear)) - VOCAB
        assert engine._weight_bytes == body + 4 * rows + 2 * head
    finally:
        engine.close()


def test_int8_dynamic_weights_are_left_to_the_models_own_forward_with_the_reason():
    """Activation quantization (int8-dynamic) is not what the int8 x bf16 kernel computes: the
    stack refuses it, and the steps run the model's own forward."""
    from torchao.quantization import quantize_

    from accelab.plan.techniques.quantization import head_modules, layer_filter, make_config
    from accelab.serve.runner import llama_stack

    model = tiny(*ARCHITECTURES["llama"])
    quantize_(
        model,
        make_config("int8-dynamic", torch.device("cpu")),
        filter_fn=layer_filter("int8-dynamic", head_modules(model)),
    )
    assert "quantized in a form other than int8 per row" in (llama_stack.why_not(model) or "")


@pytest.mark.parametrize(("rows", "queries", "keys"), [(3, 1, 40), (2, 5, 33), (1, 7, 20)])
@pytest.mark.parametrize("small", [0, 10**6], ids=["grouped", "fp32-sdpa"])
def test_bf16_attention_is_fp32_sdpa_within_bf16_rounding(rows, queries, keys, small, monkeypatch):
    """Both bf16 paths (grouped GEMMs; fp32 SDPA on copies, for small steps) against fp32 SDPA on
    the same bf16 inputs: grouped query heads (9 over 3 KV heads), causal masks at different
    positions per row."""
    from accelab.serve.runner import paged_attention

    monkeypatch.setattr(paged_attention, "SMALL_ATTENTION", small)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(rows, h, n, 16, generator=g).bfloat16() for h, n in ((9, queries), (3, keys), (3, keys)))
    positions = torch.randint(queries - 1, keys, (rows, queries), generator=g)
    mask = (torch.arange(keys) <= positions[:, :, None])[:, None]  # [B, 1, Q, L]
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True
    )
    got = paged_attention._attend(q, k, v, mask, None, None)
    assert got.dtype == torch.bfloat16
    assert float((got.float() - want).abs().max()) <= 0.02  # a few bf16 roundings of values ~1


@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8 weights, tied head"])
def test_handed_over_weights_leave_the_model_and_the_steps_and_scores_stay(int8):
    """A server's engine, once its start-up check passed, takes the model's Linear weights over
    (its stack holds them in its own layout): the model's become meta tensors (a tied head stays:
    it is the embedding), the bytes released are theirs, and the greedy tokens and the prompt
    scores (prompt logprobs, now through the stack) are those of before."""
    from torchao.quantization import quantize_

    from accelab.catalog.facts import tensor_bytes
    from accelab.plan.techniques.quantization import head_modules, layer_filter, make_config
    from accelab.serve.runner import ragged

    model = tiny(T.LlamaConfig, T.LlamaForCausalLM, {"tie_word_embeddings": int8})
    if int8:
        quantize_(
            model,
            make_config("int8-weight", torch.device("cpu")),
            filter_fn=layer_filter("int8-weight", head_modules(model)),
        )
    linears = [m for layer in model.model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    held = linears if int8 else [*linears, model.lm_head]  # tied: the head is the embedding, kept
    expected = sum(tensor_bytes(m.weight) for m in held)
    limits = SchedulerConfig(max_running=3, max_step_tokens=12, kv_blocks=12, block_size=4, prefix_caching=True)
    engine = RaggedTorchEngine(runnable(model), limits)
    try:
        assert engine.self_check(requests()[1][0]) is None
        prompt = requests()[3][0]
        scores = engine.score(prompt)  # the model's own forward
        tokens = serve(engine, limits, requests())[0]
        assert engine.hand_over_weights() == expected > 0
        assert all(m.weight.device.type == "meta" for m in held)
        assert model.model.embed_tokens.weight.device.type == "cpu"
        assert (model.lm_head.weight.device.type == "cpu") == int8  # tied: the embedding, kept
        again = engine.score(prompt)  # the stack over a scratch cache
        assert again.shape == scores.shape == (len(prompt), VOCAB)
        assert float((again - scores).abs().max()) / float(scores.abs().max()) <= ragged._tolerance(torch.float32)
        assert serve(engine, limits, requests())[0] == tokens
        assert engine.hand_over_weights() == 0  # once
    finally:
        engine.close()


def test_a_server_engine_takes_the_weights_over_layer_by_layer_and_checks_against_logits_taken_before(monkeypatch):
    """`take_over` (what a server asks): the model's own logits for the check's prompt are taken
    first, then each layer's weights leave the model as the stack packs them, so the process never
    holds them twice; the check compares with those logits, and the tokens are generate's. A stack
    that differs is then reported, with no fallback to a forward whose weights are gone."""
    from accelab.catalog.facts import tensor_bytes
    from accelab.serve.runner import llama_stack

    reqs = requests()
    model = tiny(*ARCHITECTURES["llama"])
    want = [alone(model, p, n) for p, n in reqs]
    held = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]  # untied: the head too
    expected = sum(tensor_bytes(m.weight) for m in held)
    limits = SchedulerConfig(max_running=3, max_step_tokens=12, kv_blocks=12, block_size=4, prefix_caching=True)
    engine = RaggedTorchEngine(runnable(model), limits, take_over=reqs[1][0])
    try:
        assert engine.handed_over == expected and all(m.weight.device.type == "meta" for m in held)
        assert engine.self_check(reqs[1][0]) is None and "plain tensor operations" in engine.name
        assert "known only for the prompt" in engine.self_check(reqs[0][0])  # no forward left to ask
        assert serve(engine, limits, reqs)[0] == want
    finally:
        engine.close()

    rms = llama_stack._rms
    monkeypatch.setattr(llama_stack, "_rms", lambda x, w, eps: rms(x, w, eps) * 1.01)
    faulty = RaggedTorchEngine(runnable(tiny(*ARCHITECTURES["llama"])), limits, take_over=reqs[1][0])
    try:
        problem = faulty.self_check(reqs[1][0])
        assert problem is not None and "after the prompt differ" in problem
        assert "plain tensor operations" in faulty.name  # no fallback: the model's own weights are gone
    finally:
        faulty.close()
