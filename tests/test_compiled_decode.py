"""A plan with compile on: the paged steps run compiled (inductor: one graph for decoding steps,
one for steps with prefill chunks, each for every batch, chunk and block-table size); every
request's greedy tokens equal transformers' own `generate` for it alone, and a compiled step
that differs is caught at start-up and left out."""

from __future__ import annotations

import pytest
import torch
from test_paged_architectures import ARCHITECTURES, alone, requests, runnable, serve, tiny

from accelab.ops import int8_gemm, loader as kernels
from accelab.plan.plan import Plan
from accelab.serve.runner import compiled_decode
from accelab.serve.runner.ragged import RaggedTorchEngine
from accelab.serve.scheduler import SchedulerConfig

pytestmark = pytest.mark.cpu_kind  # its path depends on the CPU (make test-avx2)

LIMITS = SchedulerConfig(max_running=3, max_step_tokens=12, kv_blocks=12, block_size=4, prefix_caching=True)


def compiled_engine(model) -> RaggedTorchEngine:
    run = runnable(model)
    run.plan = Plan(name="compile", compile="default")
    run.model.forward = torch.compile(run.model.forward)  # as the plan's compile applies it
    return RaggedTorchEngine(run, LIMITS)


@pytest.mark.parametrize(("name", "kernel"), [("mistral (sliding window 8)", True), ("qwen2", True), ("qwen2", False)])
def test_compiled_decoding_steps_give_generates_greedy_tokens(name, kernel, monkeypatch):
    """Mistral: a sliding window of 8 (masks per window in the graph); Qwen2: q|k|v biases.
    Batches of 1 to 3 sequences, chunks of 2 to 12 tokens and tables of 1 to 7 blocks run
    through the two compiled graphs, no size compiling again. The decoding attention runs the
    C++ kernel, or (where it did not build: faked here) the tensor operations."""
    if not kernel:
        monkeypatch.setattr(compiled_decode, "decode_attention_missing", lambda dtype, dim: "no compiler (faked)")
    model = tiny(*ARCHITECTURES[name])
    reqs = requests()
    want = [alone(model, p, n) for p, n in reqs]
    engine = compiled_engine(model)
    try:
        assert engine._compiled._module.kernel is kernel
        assert engine.name.endswith(", steps compiled")
        assert not hasattr(model.forward, "_torchdynamo_orig_callable")  # the reference runs eager
        assert engine.self_check(reqs[1][0]) is None
        assert engine.name.endswith(", steps compiled")
        engine._compiled.steps = 0
        kinds = []  # what each step ran as
        step = engine.step
        engine.step = lambda inputs: kinds.append(engine._compiled.takes(inputs)) or step(inputs)
        monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)  # one graph for every size
        got, sched, _ = serve(engine, LIMITS, reqs, fork_first=True)
        steps = engine._compiled.steps
    finally:
        engine.close()
    assert got[:5] == want
    assert got[5] == want[0][: len(got[5])]
    assert steps == len(kinds) and kinds.count("decode") >= 10 and kinds.count("mixed") >= 3  # all compiled
    assert sched.preemptions >= 1


def test_a_compiled_step_that_differs_is_left_out_at_start_up(monkeypatch, caplog):
    forward = compiled_decode._Decode.forward
    monkeypatch.setattr(compiled_decode._Decode, "forward", lambda self, **kw: forward(self, **kw) * 1.05)
    engine = compiled_engine(tiny(*ARCHITECTURES["llama"]))
    try:
        with caplog.at_level("WARNING"):
            assert engine.self_check(list(range(5, 25))) is None
        assert "compiled" not in engine.name and engine._compiled is None
        assert "not used (its logits of a decoding step differ from the eager steps'" in caplog.text
    finally:
        engine.close()


def _int8_engine(head: bool = False, dtype: torch.dtype = torch.bfloat16) -> RaggedTorchEngine:
    from torchao.quantization import quantize_

    from accelab.plan.techniques.quantization import head_modules, layer_filter, make_config

    model = tiny(*ARCHITECTURES["llama"]).to(dtype)
    config = make_config("int8-weight", torch.device("cpu"))
    quantize_(model, config, filter_fn=layer_filter("int8-weight", set() if head else head_modules(model)))
    run = runnable(model)
    run.plan = Plan(name="int8-compile", compile="default")
    return RaggedTorchEngine(run, LIMITS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16-amx", "f32-avx2"])
@pytest.mark.parametrize("head", [False, True], ids=["head-float", "head-int8"])
def test_int8_weights_run_compiled_through_the_int8_gemm_operator(head, dtype):
    """int8 weight-only (torchao, a scale a row) in bf16 (the AMX operator) or float32 (the AVX2
    one): the compiled steps keep the weights int8 and call the operator from the graph; their
    logits pass the start-up check against the eager steps, with the output layer float or
    (`quantize_head`) int8 too. An operator this CPU lacks is skipped with the reason."""
    kernel = int8_gemm.for_dtype(dtype)
    missing = [flag for flag in kernel.library.needs if flag not in kernels.cpu_flags()]
    if missing:
        pytest.skip(f"{kernel.name}: this CPU lacks {', '.join(missing)}")
    engine = _int8_engine(head, dtype)
    try:
        module = engine._compiled._module
        assert [module.weights[j].dtype for j in range(1, 5)] == [torch.int8] * 4  # the layer's four GEMMs
        assert module.weights[0].dtype == (torch.int8 if head else dtype)  # the output layer
        assert module.int8_kernel is kernel
        assert engine.self_check(requests()[1][0]) is None
        assert engine.name.endswith(", steps compiled")
        got, _, _ = serve(engine, LIMITS, requests())
    finally:
        engine.close()
    assert [len(tokens) for tokens in got[:5]] == [n for _, n in requests()]


def test_int8_weights_the_operator_cannot_run_step_eager_and_say_why(monkeypatch, caplog):
    """Where the int8 operator does not run (faked here: a CPU without it), the compiled plan still
    serves continuously, its steps eager, and one log line says why (it once crashed the server)."""
    monkeypatch.setattr(int8_gemm, "available", lambda n, k, dtype=None: "it needs a CPU with AMX (faked)")
    with caplog.at_level("WARNING"):
        engine = _int8_engine()
    try:
        assert engine._compiled is None and "compiled" not in engine.name
        assert engine.self_check(requests()[1][0]) is None
        got, _, _ = serve(engine, LIMITS, requests())
    finally:
        engine.close()
    assert [len(tokens) for tokens in got[:5]] == [n for _, n in requests()]
    lines = [r.getMessage() for r in caplog.records if "run eager" in r.getMessage()]
    assert lines == [
        "the plan compiles, but the continuous steps run eager: the plan compiles the model, and the continuous "
        "steps cannot be compiled: its weights are int8 and the int8 GEMM operator does not run them: it needs a "
        "CPU with AMX (faked)"
    ]


def test_a_step_that_would_compile_again_runs_eager_from_then_on(caplog):
    """A guard of the compiled graph that fails mid-serving (here: a constant it was compiled
    with, changed) would stall every request for a compile: the engine steps eager instead."""
    model = tiny(*ARCHITECTURES["llama"])
    reqs = requests()
    want = [alone(model, p, n) for p, n in reqs]
    engine = compiled_engine(model)
    try:
        assert engine.self_check(reqs[1][0]) is None
        engine._compiled._module.eps *= 2  # the compiled step's guards see another constant
        with caplog.at_level("WARNING"):
            got, _, _ = serve(engine, LIMITS, reqs)
        assert engine._compiled is None and "compiled" not in engine.name
    finally:
        engine.close()
    assert got == want
    assert "the compiled steps are not used (it would compile again" in caplog.text


def test_a_step_whose_prefill_attention_would_be_large_runs_eager(monkeypatch):
    """Above SCORES_LIMIT (chunks x their longest x key positions) a step with prefill chunks
    runs eager; decoding steps stay compiled; the tokens are generate's."""
    monkeypatch.setattr(compiled_decode, "SCORES_LIMIT", 2 * 12 * 12)  # the start-up check's chunk fits
    model = tiny(*ARCHITECTURES["llama"])
    reqs = requests()
    want = [alone(model, p, n) for p, n in reqs]
    engine = compiled_engine(model)
    try:
        assert engine.self_check(reqs[1][0][:12]) is None
        engine._compiled.steps = 0
        kinds = []
        step = engine.step
        engine.step = lambda inputs: kinds.append(engine._compiled.takes(inputs)) or step(inputs)
        got, _, _ = serve(engine, LIMITS, reqs)
        steps = engine._compiled.steps
    finally:
        engine.close()
    assert got == want
    assert None in kinds and steps == len(kinds) - kinds.count(None) > 0
