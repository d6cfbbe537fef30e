"""LLM serving against the field's servers, in one run on one machine: the same model, the same
closed-loop streaming chat load, every server up at once.

- `accelab serve` on its torch step engine at each precision: fp32 (the baseline), `--plan bf16`,
  and `--plan int8-bf16` (int8 weights, bf16 activations); `--plan 'bf16[compile=default]'`: bf16
  with its decoding steps compiled (`serve/runner/compiled_decode.py`);
- `accelab serve --plan 'llamacpp[llama_quant=q8_0]'` (the catalog's GGUF requantised to Q8_0:
  llama.cpp has batched kernels for Q8_0 on x86);
- `accelab serve --plan openvino-int8-bf16`: OpenVINO GenAI's ContinuousBatchingPipeline (int8
  weights by NNCF, bf16 inference; .venv-openvino: `make openvino`) behind accelab's server, held to
  the pipeline's own rate alone (`benchmarks/ov_engine_alone.py`, no accelab, no HTTP);
- vLLM CPU's `vllm serve` (.venv-vllm: `make vllm`) at its defaults (compiled), in bf16 and in fp32;
  `--enforce-eager` (its compilation off) only with --handicapped, and labelled so;
- llama.cpp's own `llama-server` on the same Q8_0 GGUF with one slot per user over a unified KV
  cache (benchmarks/peers/build_llama_server.sh);
- on request (--only): the Q4_1 GGUF through accelab, the server at an earlier commit
  (--before), `transformers serve --continuous-batching`.

`--model llama-1b` runs the catalog's Llama-3.2-1B-shaped model (random weights, real size: the
GEMM-bound regime) instead of SmolLM2-135M; it has no GGUF, so the llama.cpp servers sit out.

For each level of users the servers take turns in rounds, A B C ... then ... C B A, so a busy
minute of this shared machine hits every server alike; each window records the CPU steal and the
CPU other processes took (`benchmarks/llm_servers.py`), and for accelab's servers the mean step
time and its fraction of the machine's bound from /metrics. Reported per server: the median round
and the quietest round, and the ratios of accelab's best to each peer's best paired round by
round. Then each step engine alone (no HTTP), llama.cpp's own `llama-batched-bench`, and guidellm
(an independent client) on the main servers at 8 users.

    python benchmarks/serve_llm.py                                 # ~35 min on 2 cores
    python benchmarks/serve_llm.py --users 8 --rounds 2 --duration 15 --only torch-bf16,vllm-bf16
    python benchmarks/serve_llm.py --model llama-1b --users 1,8,16 --no-extras
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import llm_servers as S
from machine import cpu_line, cpu_record

from accelab.catalog.store import model_dir

GGUF = "gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
BEFORE = "e7af23b"  # the last commit that landed before this work (the paged KV cache, the packed steps)
RESULTS = Path(__file__).parent / "results"
GUIDELLM = S.ROOT / ".venv-guidellm" / "bin" / "guidellm"
BATCHED_BENCH = S.LLAMA_SERVER.parent / "llama-batched-bench"


MODELS = {"smollm2-135m": GGUF, "llama-1b": None}  # model -> its GGUF in the model directory (None: none)
# the default servers per CPU kind: where bf16 is native (AVX512-BF16, AMX) the bf16 plans and peers,
# where it is emulated (AVX2) their float32 twins (bf16 there serves a fraction of fp32's rate)
MAIN_BF16 = (
    "torch",
    "torch-bf16",
    "torch-bf16-compiled",
    "torch-int8",
    "torch-int8-head-compiled",
    "llamacpp-q8_0",
    "ov-int8-bf16",
    "vllm-bf16",
    "vllm-fp32",
    "vllm-w8a8",
    "llama-server",
)
MAIN_F32 = (
    "torch",
    "torch-compiled",
    "torch-int8f32",
    "torch-int8f32-compiled",
    "torch-int8f32-head-compiled",
    "llamacpp-q8_0",
    "ov-int8",
    "vllm-fp32",
    "vllm-w8a8",
    "llama-server",
    "llama-server-q4_0",
)
OWN = (  # accelab's own torch engine
    "torch",
    "torch-bf16",
    "torch-bf16-compiled",
    "torch-compiled",
    "torch-int8",
    "torch-int8-compiled",
    "torch-int8-head-compiled",
    "torch-int8f32",
    "torch-int8f32-compiled",
    "torch-int8f32-head-compiled",
)
ACCELAB = (*OWN, "llamacpp", "llamacpp-q8_0", "ov-int8-bf16", "ov-int8", "before")
COMPILED = "bf16[compile=default]"  # bf16 with the decoding steps compiled
INT8_COMPILED = "int8-bf16[compile=default]"  # int8 weights (the AMX int8 GEMM where it runs), steps compiled
INT8_HEAD_COMPILED = "int8-bf16[compile=default;quantize_head=true]"  # the output head int8 too
# int8 weights with float32 activations (the AVX2 int8 GEMM), eager, compiled, and the head int8 too
INT8F32 = ("int8-weight", "int8-weight[compile=default]", "int8-weight[compile=default;quantize_head=true]")
OV_PLAN = "openvino-int8-bf16"
OV_PLAN_F32 = "openvino-int8"  # int8 weights, f32 inference: where bf16 is emulated
VLLM = ("vllm-bf16", "vllm-fp32", "vllm-w8a8")  # vLLM at its defaults (compiled) in each precision it serves
# their best documented configurations (not the handicapped); OpenVINO GenAI's pipeline alone joins them
# (extra["ov_engine_alone"]: no HTTP, the served load's mix)
PEERS = (*VLLM, "llama-server", "llama-server-q4_0")


def native_bf16() -> bool:
    from accelab import cpu

    return cpu.native_bf16()


def main_servers() -> tuple[str, ...]:
    return MAIN_BF16 if native_bf16() else MAIN_F32


def w8a8_checkpoint(model: str) -> Path:
    """vLLM CPU's int8 peer: llm-compressor's W8A8 of the model (benchmarks/peers/make_w8a8.sh)."""
    return peer_file("make_w8a8.sh", model)


def peer_file(script: str, model: str) -> Path:
    """The file a benchmarks/peers script makes for `model` (made once, cached; its last line names it)."""
    done = subprocess.run(
        ["bash", str(Path(__file__).parent / "peers" / script), model], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"{script} {model} failed:\n{done.stderr[-3000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def source_gguf(model: str) -> Path:
    """The GGUF llama-server's peers are requantised from: the one the model directory ships, else
    one made by llama.cpp's own converter (benchmarks/peers/convert_gguf.sh: bf16, ~1-2 min once)."""
    gguf = MODELS[model]
    if gguf is not None:
        return model_dir(model) / gguf
    return peer_file("convert_gguf.sh", model)


def q4_0_gguf(model: str) -> Path:
    """The model's GGUF requantised to Q4_0, which llama.cpp repacks for AVX2 at load."""
    from accelab.backends.llamacpp import requantized

    return requantized(source_gguf(model), "q4_0", 2)


def q8_0_gguf(model: str) -> Path:
    """The model's GGUF requantised to Q8_0 by llama.cpp (what accelab's llamacpp[llama_quant=q8_0] serves)."""
    from accelab.backends.llamacpp import requantized

    return requantized(source_gguf(model), "q8_0", 2)


def contenders(opts: argparse.Namespace, before_src: Path | None) -> dict[str, S.Server]:
    model = opts.model
    path = model_dir(model)
    users = max(opts.users)
    seqs = max(users, 8)
    common = ["--max-batch-size", str(seqs), "--max-queue", "256", "--request-timeout", "600"]
    common += ["--max-tokens", str(max(S.MIX))]
    # Llama-3.2-1B's 131072 positions of KV would not fit vLLM CPU's 2 GiB cache: 4096 is plenty here,
    # and accelab's KV cache (by default at least the model's context: 4.3 GB in bf16) gets vLLM's 2 GiB
    context = 4096 if model == "llama-1b" else None
    if context:
        common += ["--kv-cache-tokens", "32768"]
    float_dtype = "bfloat16" if native_bf16() else "float32"  # vLLM's W8A8 activations, where int8 does not run
    out = {
        "torch": S.accelab("accelab serve (torch fp32)", model, *common),
        "torch-bf16": S.accelab("accelab serve --plan bf16", model, *common, "--plan", "bf16"),
        "torch-bf16-compiled": S.accelab(f"accelab serve --plan '{COMPILED}'", model, *common, "--plan", COMPILED),
        "torch-compiled": S.accelab(
            "accelab serve --plan 'baseline[compile=default]'", model, *common, "--plan", "baseline[compile=default]"
        ),
        "torch-int8": S.accelab("accelab serve --plan int8-bf16", model, *common, "--plan", "int8-bf16"),
        "torch-int8-compiled": S.accelab(
            f"accelab serve --plan '{INT8_COMPILED}'", model, *common, "--plan", INT8_COMPILED
        ),
        "torch-int8-head-compiled": S.accelab(
            f"accelab serve --plan '{INT8_HEAD_COMPILED}'", model, *common, "--plan", INT8_HEAD_COMPILED
        ),
        "ov-int8-bf16": S.accelab(f"accelab serve --plan {OV_PLAN}", model, *common, "--plan", OV_PLAN),
        "ov-int8": S.accelab(f"accelab serve --plan {OV_PLAN_F32}", model, *common, "--plan", OV_PLAN_F32),
        **{
            key: S.accelab(f"accelab serve --plan '{plan}'", model, *common, "--plan", plan)
            for key, plan in zip(("torch-int8f32", "torch-int8f32-compiled", "torch-int8f32-head-compiled"), INT8F32)
        },
        "vllm-bf16": S.vllm_serve(path, model, max_num_seqs=seqs, dtype="bfloat16", max_model_len=context),
        "vllm-fp32": S.vllm_serve(path, model, max_num_seqs=seqs, dtype="float32", max_model_len=context),
        "vllm-eager": S.vllm_serve(path, model, max_num_seqs=seqs, dtype="float32", eager=True, max_model_len=context),
        "transformers": S.transformers_serve(path),
    }
    wanted = opts.only.split(",") if opts.only else list(main_servers())
    if "vllm-w8a8" in wanted:  # made only when asked for: ~3-5 min the first time
        out["vllm-w8a8"] = S.vllm_serve(
            w8a8_checkpoint(model), model, max_num_seqs=seqs, dtype=float_dtype, max_model_len=context, label="W8A8"
        )
    if MODELS[model] is not None:  # accelab's llama.cpp plans serve the GGUF the model directory ships
        out["llamacpp"] = S.accelab("accelab serve --plan llamacpp (Q4_1)", model, *common, "--plan", "llamacpp")
        out["llamacpp-q8_0"] = S.accelab(
            "accelab serve --plan llamacpp[llama_quant=q8_0]", model, *common, "--plan", "llamacpp[llama_quant=q8_0]"
        )
    if any(k.startswith("llama-server") for k in wanted):  # the peer: any model, converted where it has no GGUF
        if not S.LLAMA_SERVER.exists():
            raise SystemExit(f"no {S.LLAMA_SERVER}: run `bash benchmarks/peers/build_llama_server.sh` (10-25 min)")
        out["llama-server"] = S.llama_server(q8_0_gguf(model), model, slots=seqs, threads=opts.llama_threads)
        out["llama-server-q4_0"] = S.llama_server(q4_0_gguf(model), model, slots=seqs, threads=opts.llama_threads)
    if before_src is not None:
        out["before"] = S.accelab(
            f"accelab serve (torch fp32) at {opts.before}", model, *common, pythonpath=str(before_src)
        )
        out["before-bf16"] = S.accelab(
            f"accelab serve --plan bf16 at {opts.before}", model, *common, "--plan", "bf16", pythonpath=str(before_src)
        )
        out["before-bf16-compiled"] = S.accelab(
            f"accelab serve --plan '{COMPILED}' at {opts.before}",
            model,
            *common,
            "--plan",
            COMPILED,
            pythonpath=str(before_src),
        )
        out["before-int8f32-head-compiled"] = S.accelab(  # the fastest own plan where bf16 is emulated
            f"accelab serve --plan '{INT8F32[2]}' at {opts.before}",
            model,
            *common,
            "--plan",
            INT8F32[2],
            pythonpath=str(before_src),
        )
    wanted = [k for k in wanted if k in out or opts.only]  # the default set where this model has them
    if opts.handicapped and "vllm-eager" not in wanted:
        wanted.append("vllm-eager")
    missing = [k for k in wanted if k not in out]
    if missing:
        raise SystemExit(f"--only names {missing}; for {model} choose from {sorted(out)}")
    if any(k.startswith("vllm") for k in wanted) and not S.VLLM_PYTHON.exists():
        raise SystemExit("no .venv-vllm: run `make vllm`")
    return {k: out[k] for k in wanted}


# -- the rounds ------------------------------------------------------------------------------------
def measure(servers: dict[str, S.Server], opts: argparse.Namespace) -> None:
    for users in opts.users:
        for r, order in enumerate(S.rotation(list(servers.values()), opts.rounds)):
            for server in order:
                before = step_figures(server)
                row = S.window(server, users, opts.duration)
                row.update(step_delta(before, step_figures(server)))
                row["round"] = r
                server.windows.setdefault(users, []).append(row)
                print(
                    f"  round {r + 1} {users:>2} users  {server.label:<44} {row['tokens_per_s']:7.1f} tok/s  "
                    f"TTFT p50 {fmt(row['ttft_p50_ms'])} p99 {fmt(row['ttft_p99_ms'])} ms  "
                    f"steal {pct(row['steal'])}  others {fmt(row['others_cores'], 2)} cores  "
                    f"errors {row['errors']}"
                    + (
                        f"  step {row['step_ms']:.1f} ms, {pct(row['step_fraction'])} of the machine's bound"
                        if row.get("step_fraction") is not None
                        else ""
                    ),
                    flush=True,
                )


def step_figures(server: S.Server) -> dict[str, float] | None:
    """An accelab server's step counters from /metrics (None for the peers, or when absent)."""
    if not server.ready_path == "/readyz":
        return None
    import httpx

    wanted = (
        "accelab_batch_seconds_sum",
        "accelab_batch_seconds_count",
        "accelab_step_machine_fraction_sum",
        "accelab_step_machine_fraction_count",
    )
    values = {}
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in wanted:
            values[name] = float(value)
    return values or None


def step_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float | None]:
    """Mean step time and mean fraction of the machine's bound over one window."""
    if not before or not after:
        return {}

    def change(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    steps, fractions = change("accelab_batch_seconds_count"), change("accelab_step_machine_fraction_count")
    return {
        "step_ms": 1000 * change("accelab_batch_seconds_sum") / steps if steps else None,
        "step_fraction": change("accelab_step_machine_fraction_sum") / fractions if fractions else None,
    }


def quietest_round(servers: dict[str, S.Server], users: int) -> int:
    rounds = len(next(iter(servers.values())).windows[users])
    return min(range(rounds), key=lambda r: sum(S.loudness(s.windows[users][r]) for s in servers.values()))


# -- what the engines do alone ---------------------------------------------------------------------
def engine_alone(model: str, plan: str, sizes: tuple[int, ...] = (1, 8, 16), steps: int = 40) -> dict[int, float]:
    """Decode tokens/s of the server's step engine alone (no HTTP, no scheduler), at each batch
    size: the most its users can get."""
    import torch

    from accelab.catalog.resolve import resolve
    from accelab.plan.plan import load_plan
    from accelab.serve.engines import build_engine
    from accelab.serve.engines.base import SamplingParams, StepInput
    from accelab.serve.scheduler import SchedulerConfig

    engine = build_engine(resolve(model), load_plan(plan), torch.device("cpu"), name="alone")
    limits = SchedulerConfig(max_running=max(sizes), max_step_tokens=4096, kv_blocks=256, block_size=16)
    stepper = engine.step_engine(limits)
    greedy = SamplingParams(max_tokens=steps + 1, temperature=0)
    prompt = tuple(engine.prepare_chat([{"role": "user", "content": "Tell me a story."}]).ids)
    per = -(-(len(prompt) + steps + 1) // limits.block_size)
    if hasattr(stepper, "self_check"):  # as the server starts it: a compiling plan compiles its step here
        stepper.self_check(list(prompt))
    rates = {}
    try:
        for size in sizes:
            ids = range(size)
            blocks = {i: tuple(range(i * per, (i + 1) * per)) for i in ids}
            fed = [
                StepInput(seq_id=i, start=0, tokens=prompt, sample=True, params=greedy, blocks=blocks[i]) for i in ids
            ]
            tokens = [t.token for t in stepper.step(fed)]
            started = time.perf_counter()
            for k in range(steps):
                fed = [
                    StepInput(
                        seq_id=i, start=len(prompt) + k, tokens=(t,), sample=True, params=greedy, blocks=blocks[i]
                    )
                    for i, t in zip(ids, tokens)
                ]
                tokens = [t.token for t in stepper.step(fed)]
            rates[size] = size * steps / (time.perf_counter() - started)
            for i in ids:
                stepper.release(i)
    finally:
        stepper.close()
        engine.close()
    return rates


def ov_engine_alone(model: str, tmp: Path, plan: str = OV_PLAN) -> dict[str, dict[int, float]] | None:
    """OpenVINO GenAI's pipeline alone, with the settings accelab's engine process builds for
    `plan`, on the served chat prompts: tokens/s of 1, 8 and 16 sequences in lockstep and under the
    served closed-loop mix (benchmarks/ov_engine_alone.py)."""
    from accelab.backends import openvino_genai as G
    from accelab.catalog import inputs
    from accelab.catalog.load import load_processor
    from accelab.catalog.resolve import resolve
    from accelab.plan.backend_options import OvOptions
    from accelab.plan.plan import load_plan

    install, reason = G.find_genai()
    if install is None:
        print(f"no OpenVINO GenAI: {reason}", flush=True)
        return None
    spec = resolve(model, fetch=False)
    options = OvOptions.parse(load_plan(plan).option)
    config = G.engine_config(G.exported(spec, options.weights, install), options, keep_s=0, threads=None)
    tokenizer = load_processor(spec)
    prompts = []
    for text in inputs.prompts(52):  # the served load's prompts, as accelab's chat template makes them
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    load = tmp / "ov_load.json"
    load.write_text(json.dumps({"prompts": prompts, "mix": list(S.MIX)}))
    script = Path(__file__).with_name("ov_engine_alone.py")
    command = [str(install.python), "-P", str(script), "--config", config.to_json(), "--prompts", str(load)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(f"ov_engine_alone failed:\n{done.stderr[-2000:]}", flush=True)
        return None
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return {kind: {int(k): v for k, v in rates.items()} for kind, rates in found.items()}


def batched_bench(gguf: Path | None, threads: int) -> dict[int, float] | None:
    """llama.cpp's own batched decoding on the GGUF (llama-batched-bench): text-generation
    tokens/s of 1, 8 and 16 parallel sequences."""
    if gguf is None or not BATCHED_BENCH.exists():
        return None
    cmd = [
        str(BATCHED_BENCH),
        "-m",
        str(gguf),
        "-c",
        "8192",
        "-b",
        "2048",
        "-ub",
        "512",
        "-npp",
        "64",
        "-ntg",
        "64",
        "-npl",
        "1,8,16",
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "--output-format",
        "jsonl",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    rates = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            rates[int(row["pl"])] = float(row["speed_tg"])
    return rates or None


def guidellm(server: S.Server, streams: int, seconds: float, tmp: Path, model: str) -> dict[str, Any] | None:
    """guidellm's own measurement of the server at `streams` concurrent streams."""
    if not GUIDELLM.exists():
        return None
    out = tmp / f"guidellm-{server.port}.json"
    cmd = [
        str(GUIDELLM),
        "run",
        "--backend",
        f"kind=openai_http,target={server.url},model={server.model}",
        "--profile",
        f"kind=concurrent,streams={streams}",
        "--data",
        "kind=synthetic_text,prompt_tokens=64,output_tokens=64",
        "--tokenizer",
        f"kind=huggingface_auto,model={model_dir(model)}",
        "--constraint",
        f"kind=max_duration,seconds={seconds:g}",
        "--output",
        f"kind=json,path={out}",
        "--disable-console-interactive",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp, check=False)
    if done.returncode != 0 or not out.exists():
        print(f"  guidellm against {server.label} failed ({done.returncode}): {done.stdout[-800:]}")
        return None
    return _guidellm_rates(json.loads(out.read_text()))


def _guidellm_rates(report: dict[str, Any]) -> dict[str, Any]:
    """guidellm's own figures: output tokens of its successful requests over its run's duration
    (what its table calls output tok/s), TTFT and ITL medians, and its request counts."""
    bench = report["benchmarks"][0]
    metrics = bench["metrics"]

    def successful(name: str, stat: str) -> float | None:
        return ((metrics.get(name) or {}).get("successful") or {}).get(stat)

    totals = metrics.get("request_totals") or {}
    tokens = successful("output_token_count", "total_sum")
    # every token streamed, the requests its time limit cut off included: with 64-token answers
    # a 40 s run completes only a handful per stream, so the successful ones alone come in steps
    streamed = ((metrics.get("output_token_count") or {}).get("total") or {}).get("total_sum")
    duration = bench.get("duration")
    return {
        "output_tokens_per_s": tokens / duration if tokens is not None and duration else None,
        "streamed_tokens_per_s": streamed / duration if streamed is not None and duration else None,
        "ttft_ms_p50": successful("time_to_first_token_ms", "median"),
        "itl_ms_p50": successful("inter_token_latency_ms", "median"),
        "successful": totals.get("successful"),
        "errored": totals.get("errored"),
        "incomplete": totals.get("incomplete"),
    }


# -- the report ----------------------------------------------------------------------------------
def fmt(value: Any, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def report(servers: dict[str, S.Server], extra: dict[str, Any], opts: argparse.Namespace) -> str:
    lines = [
        cpu_line(),
        f"{opts.model}, closed-loop streaming chat, greedy, max_tokens cycling {','.join(map(str, S.MIX))}; "
        f"{opts.rounds} rounds of {opts.duration:g} s windows per level, servers in turn (A B C ... C B A); "
        f"{os.cpu_count()} CPU cores; every server up throughout",
        "",
    ]
    for users in opts.users:
        quiet = quietest_round(servers, users)
        lines.append(f"{users} user{'s' if users > 1 else ''}:")
        lines.append(
            "| server | tok/s median | tok/s quietest round | TTFT p50 / p99 ms (median round) | "
            "ITL p50 ms | requests | errors | steal, other cores (median round) | step ms, of machine bound "
            "(median round) | tok/s per round |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|---|")
        for server in servers.values():
            rows = server.windows[users]
            mid = S.median_row(rows)
            lines.append(
                f"| {server.label} | {fmt(mid['tokens_per_s'], 1)} | {fmt(rows[quiet]['tokens_per_s'], 1)} | "
                f"{fmt(mid['ttft_p50_ms'])} / {fmt(mid['ttft_p99_ms'])} | {fmt(mid['itl_p50_ms'], 1)} | "
                f"{mid['requests']} | {mid['errors'] + mid['empty_answers']} | {pct(mid['steal'])}, "
                f"{fmt(mid['others_cores'], 2)} | {step_cell(mid)} | "
                f"{', '.join(fmt(r['tokens_per_s'], 1) for r in rows)} |"
            )
        lines.append(f"(quietest round: {quiet + 1})")
        lines.append("")
    alone = extra.get("engine_alone") or {}
    for label, rates in alone.items():
        lines.append(
            f"{label} step engine alone, decode tok/s: "
            + ", ".join(f"{rate:.1f} at {size}" for size, rate in rates.items())
            + f" ({rates[8] / rates[1]:.2f}x at 8 over 1)"
        )
    if extra.get("ov_engine_alone"):
        found = extra["ov_engine_alone"]
        for kind, what in (("lockstep", "64 greedy tokens in lockstep"), ("closed_loop", "the served load's mix")):
            lines.append(
                f"OpenVINO GenAI's pipeline alone ({extra.get('ov_plan')}'s settings, no accelab, no HTTP), {what}, "
                "tok/s: " + ", ".join(f"{rate:.1f} at {size}" for size, rate in found[kind].items())
            )
    if extra.get("batched_bench"):
        rates = extra["batched_bench"]
        lines.append(
            "llama.cpp's own llama-batched-bench (same GGUF), decode tok/s: "
            + ", ".join(f"{rate:.1f} at {size}" for size, rate in rates.items())
            + (f" ({rates[8] / rates[1]:.2f}x at 8 over 1)" if 1 in rates and 8 in rates else "")
        )
    for label, row in (extra.get("guidellm") or {}).items():
        if row:
            lines.append(
                f"guidellm, 8 streams, 64 in / 64 out, against {label}: {fmt(row['output_tokens_per_s'], 1)} "
                f"output tok/s ({fmt(row.get('streamed_tokens_per_s'), 1)} with the cut-off requests' tokens), "
                f"TTFT p50 {fmt(row['ttft_ms_p50'])} ms, ITL p50 {fmt(row['itl_ms_p50'], 1)} ms, "
                f"{row['successful']} ok / {row['errored']} errors / {row['incomplete']} cut off at the end"
            )
    lines.append("")
    lines += verdicts(servers, opts, extra)
    lines.append("")
    lines.append("each server by hand:")
    lines += [
        f"  {s.shell()} &".replace(s.env.get("PYTHONPATH", "\0"), f"<a checkout of {opts.before}>/src")
        for s in servers.values()
    ]
    lines.append(
        f"  accelab loadtest URL --endpoint chat --concurrency 8 --duration {opts.duration:g} "
        f"--max-tokens {','.join(map(str, S.MIX))} --warmup 8"
    )
    lines.append(f"reproduce: python {shlex.join(sys.argv)}")
    return "\n".join(lines)


def paired(servers: dict[str, S.Server], a: str, b: str, users: int) -> tuple[float, list[float]] | None:
    """accelab's tokens/s over a peer's, round by round (the same minute of the machine): the median and each."""
    if a not in servers or b not in servers or users not in servers[a].windows:
        return None
    ratios = [
        x["tokens_per_s"] / y["tokens_per_s"]
        for x, y in zip(servers[a].windows[users], servers[b].windows[users])
        if x["tokens_per_s"] and y["tokens_per_s"]
    ]
    return (S.median(ratios), ratios) if ratios else None


def step_cell(row: dict[str, Any]) -> str:
    if row.get("step_ms") is None:
        return "-"
    return f"{row['step_ms']:.1f} ms, {pct(row.get('step_fraction'))}"


def best(servers: dict[str, S.Server], keys: tuple[str, ...], users: int) -> str | None:
    """Of `keys`, the server with the highest median tokens/s at `users`."""
    present = [k for k in keys if k in servers and users in servers[k].windows]
    if not present:
        return None
    return max(present, key=lambda k: S.median([r["tokens_per_s"] for r in servers[k].windows[users]]) or 0.0)


def verdicts(servers: dict[str, S.Server], opts: argparse.Namespace, extra: dict[str, Any]) -> list[str]:
    out = ["targets (issues 31, 38):"]

    def check(text: str, ok: bool) -> None:
        out.append(f"  [{'OK' if ok else 'MISSED'}] {text}")

    def ratio_line(a: str | None, b: str | None, users: int, target: float, what: str) -> None:
        got = paired(servers, a, b, users) if a and b else None
        if got:
            check(
                f"{what} ({servers[a].label} over {servers[b].label}): {got[0]:.2f}x "
                f"(rounds: {', '.join(f'{r:.2f}' for r in got[1])}; target >= {target}x)",
                got[0] >= target,
            )

    for users in (8, 16):
        mine, theirs = best(servers, OWN, users), best(servers, VLLM, users)
        ratio_line(mine, theirs, users, 1.5, f"{users} users, accelab's own engine at its best over vLLM at its best")
        ratio_line(
            mine, best(servers, ("llama-server", "llama-server-q4_0"), users), users, 1.0,
            f"{users} users, accelab's own engine at its best over llama-server at its best",
        )  # fmt: skip
        alone = (extra.get("ov_engine_alone") or {}).get("closed_loop") or {}
        if mine and users in alone:
            served = S.median([r["tokens_per_s"] for r in servers[mine].windows[users]]) or 0.0
            check(
                f"{users} users, {servers[mine].label} at {served:.1f} tok/s over OpenVINO GenAI's pipeline alone "
                f"({extra.get('ov_plan')}, no HTTP, the same load's mix) at {alone[users]:.1f}: "
                f"{served / alone[users]:.2f}x (target >= 1.0x)",
                served >= alone[users],
            )
        if mine and theirs:
            a, b = S.median_row(servers[mine].windows[users]), S.median_row(servers[theirs].windows[users])
            check(
                f"{users} users, TTFT p99 {fmt(a['ttft_p99_ms'])} ms ({servers[mine].label}) vs "
                f"{fmt(b['ttft_p99_ms'])} ms ({servers[theirs].label}) (median rounds; target: no worse)",
                (a["ttft_p99_ms"] or 0) <= (b["ttft_p99_ms"] or 0),
            )
    for users in (8, 16):
        ratio_line(
            best(servers, ("torch-int8f32", "torch-int8f32-compiled", "torch-int8f32-head-compiled"), users),
            best(servers, ("torch", "torch-compiled"), users), users, 1.3,
            f"{users} users, accelab's int8 (f32 activations) over its fp32, eager or compiled",
        )  # fmt: skip
    ratio_line("torch-bf16", "torch", 8, 1.6, "8 users, --plan bf16 over the fp32 baseline, tokens/s")
    ratio_line("torch-bf16-compiled", "torch", 8, 1.6, f"8 users, --plan '{COMPILED}' over the fp32 baseline, tokens/s")
    ratio_line(best(servers, ACCELAB, 1), "vllm-bf16", 1, 1.0, "1 user, accelab's best over vLLM bf16, tokens/s")
    alone = extra.get("ov_engine_alone") or {}
    ov_key = "ov-int8-bf16" if extra.get("ov_plan") == OV_PLAN else "ov-int8"
    if alone and ov_key in servers and 8 in servers[ov_key].windows:
        served = S.median([r["tokens_per_s"] for r in servers[ov_key].windows[8]]) or 0.0
        for kind, what in (("closed_loop", "under the same load"), ("lockstep", "in lockstep, 64 tokens each")):
            rate = alone[kind][8]
            check(
                f"8 users, accelab serve --plan {extra.get('ov_plan')} at {served:.1f} tok/s over its pipeline alone "
                f"at 8 sequences {what}, {rate:.1f} tok/s: {served / rate:.2f}x (target >= 0.95x)",
                served >= 0.95 * rate,
            )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(MODELS))
    parser.add_argument("--users", default="1,8,16", help="closed-loop levels, comma-separated")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per window")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per level (each server once per round)")
    parser.add_argument(
        "--only",
        default="",
        help=f"servers, comma-separated (default where bf16 is native: {','.join(MAIN_BF16)}; else "
        f"{','.join(MAIN_F32)}; also llamacpp, transformers, vllm-eager, and at --before's code: before, "
        "before-bf16, before-bf16-compiled, before-int8f32-head-compiled)",
    )
    parser.add_argument("--handicapped", action="store_true", help="also vLLM with --enforce-eager, labelled so")
    parser.add_argument("--before", default=BEFORE, help="the earlier commit for --only ...,before")
    parser.add_argument("--llama-threads", type=int, default=2, help="llama-server's threads")
    parser.add_argument("--no-extras", action="store_true", help="skip the engines alone, batched-bench, guidellm")
    parser.add_argument("--out", default="", help="default: results/serve_llm.txt (serve_llm-MODEL.txt for others)")
    opts = parser.parse_args()
    opts.users = [int(u) for u in opts.users.split(",")]
    opts.out = opts.out or str(
        RESULTS / ("serve_llm.txt" if opts.model == "smollm2-135m" else f"serve_llm-{opts.model}.txt")
    )
    started = time.monotonic()
    wants_before = opts.before and {k for k in opts.only.split(",") if k.startswith("before")}
    with (
        tempfile.TemporaryDirectory(prefix="serve_llm-") as tmp,
        S.source_at(opts.before if wants_before else None, Path(tmp) / "before") as before_src,
    ):
        servers = contenders(opts, before_src)
        extra: dict[str, Any] = {}
        try:
            for server in servers.values():
                print(f"starting {server.label}: {server.shell()}", flush=True)
                S.start(server, Path(tmp))
            for server in servers.values():
                S.wait_ready(server)
                print(f"ready: {server.label}", flush=True)
            measure(servers, opts)
            if not opts.no_extras:
                extra["guidellm"] = {
                    s.label: guidellm(s, 8, 40, Path(tmp), opts.model)
                    for k, s in servers.items()
                    if k in ("torch-bf16-compiled", "torch-int8f32-head-compiled", "llamacpp-q8_0", "vllm-bf16")
                }
        finally:
            for server in servers.values():
                S.stop(server)
        ov = next((plan for key, plan in (("ov-int8-bf16", OV_PLAN), ("ov-int8", OV_PLAN_F32)) if key in servers), None)
        if ov is not None:
            extra["ov_plan"] = ov
            extra["ov_engine_alone"] = ov_engine_alone(opts.model, Path(tmp), ov)
        if not opts.no_extras:
            plans = ["baseline", "bf16", COMPILED, "int8-bf16"] if native_bf16() else ["baseline", *INT8F32]
            plans += ["llamacpp[llama_quant=q8_0]"] if MODELS[opts.model] else []
            extra["engine_alone"] = {plan: engine_alone(opts.model, plan) for plan in plans}
            extra["batched_bench"] = batched_bench(q8_0_gguf(opts.model), opts.llama_threads)
    text = report(servers, extra, opts) + f"\ntook {(time.monotonic() - started) / 60:.1f} min"
    print("\n" + text)
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    payload = {
        "cpu": cpu_record(),
        "servers": {s.label: {str(u): rows for u, rows in s.windows.items()} for s in servers.values()},
        "commands": {s.label: s.shell() for s in servers.values()},
        **extra,
        "duration_s": opts.duration,
        "rounds": opts.rounds,
        "max_tokens_mix": S.MIX,
    }
    out.with_suffix(".json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
