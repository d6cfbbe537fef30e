"""What each acceleration technique can do on this machine: "ok", "slow" (it runs, but expect
it slower than fp32 eager) or "unsupported", with the reason. Decided from the environment and,
when the measured limits are given, from what was measured: the peaks per compute path and the
probes (each technique timed on a small transformer MLP against fp32), never from a recipe.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from accelab import cpu
from accelab.backends.openvino_genai import find_genai
from accelab.backends.vllm_launch import find_vllm
from accelab.measure import hardware
from accelab.measure.environment import environment
from accelab.measure.hardware import HardwareLimits
from accelab.measure.probes import SLOW_BELOW, describe
from accelab.ops import int8_gemm

Status = Literal["ok", "slow", "unsupported"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Capability:
    """What one technique can do here. "slow": it runs, but expect it slower than fp32 eager."""

    technique: str
    status: Status
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class _Machine:
    """The facts of environment() (and optional limits) that the checks below read."""

    gpus: int
    min_cc: tuple[int, int] | None  # lowest compute capability across GPUs
    native_bf16: bool
    amx: bool
    native_fp16: bool
    versions: dict[str, str | None]
    c_compiler: str | None
    limits: HardwareLimits | None

    @classmethod
    def of(cls, env: dict[str, Any], limits: HardwareLimits | None) -> _Machine:
        ccs = [_parse_cc(g.get("compute_capability")) for g in env.get("gpus", [])]
        known = [cc for cc in ccs if cc is not None]
        cpu = env.get("cpu", {})
        return cls(
            gpus=len(ccs),
            min_cc=min(known) if known else None,
            native_bf16=bool(cpu.get("native_bf16")),
            amx=bool(cpu.get("torch_amx_tile")),
            native_fp16=bool(cpu.get("native_fp16")),
            versions=env.get("versions", {}),
            c_compiler=env.get("c_compiler"),
            limits=limits,
        )

    def cc_at_least(self, major: int, minor: int = 0) -> bool:
        return self.min_cc is not None and self.min_cc >= (major, minor)

    @property
    def cc_text(self) -> str:
        return f"{self.min_cc[0]}.{self.min_cc[1]}" if self.min_cc else "unknown"


def _parse_cc(text: str | None) -> tuple[int, int] | None:
    try:
        major, minor = str(text).split(".")
        return int(major), int(minor)
    except ValueError:
        return None


Check = tuple[Status, str]


def _bf16(m: _Machine) -> Check:
    if m.gpus:
        if m.cc_at_least(8):
            return "ok", f"GPU compute capability {m.cc_text} has bf16 tensor cores"
        return "slow", f"GPU compute capability {m.cc_text} < 8.0 has no bf16 tensor cores"
    if m.limits is not None and m.limits.device == "cpu" and m.limits.bf16_flops:
        bf16, fp32 = (m.limits.bf16_autocast_flops or m.limits.bf16_flops) / 1e9, m.limits.fp32_flops / 1e9
        if bf16 < 0.8 * fp32:
            return "slow", f"measured bf16 matmul {bf16:.1f} GFLOP/s vs fp32 {fp32:.1f}: expect it slower"
        return "ok", f"measured bf16 matmul {bf16:.1f} GFLOP/s vs fp32 {fp32:.1f}"
    if m.amx:
        return "ok", "torch sees AMX tiles on this CPU: native bf16 matmuls"
    if m.native_bf16:
        # Measured on an AVX512-BF16 CPU without AMX: bf16 matmul at half the fp32 rate.
        return "slow", "AVX512-BF16 but no AMX: bf16 matmuls are usually no faster than fp32 (`accelab env` measures)"
    return "slow", "runs, but this CPU has no native bf16 (torch sees no AVX512-BF16/AMX): expect it slower"


def _fp16_autocast(m: _Machine) -> Check:
    if m.gpus:
        return "ok", "CUDA autocast to fp16"
    return "unsupported", "accelerate's fp16 on CPU is a no-op (native_amp False): it would run fp32"


def _fp16_weights(m: _Machine) -> Check:
    if m.gpus:
        return "ok", "fp16 tensor cores" if m.cc_at_least(7) else f"GPU compute capability {m.cc_text}"
    if m.native_fp16:
        return "ok", "torch sees AMX-FP16 on this CPU"
    return "slow", "runs, but torch sees no native fp16 (AMX-FP16) on this CPU: expect it slower"


def _fp8(m: _Machine) -> Check:
    if not m.gpus:
        return "unsupported", "needs a GPU with compute capability >= 8.9; no GPU here"
    if not m.cc_at_least(8, 9):
        return "unsupported", f"needs compute capability >= 8.9; this GPU is {m.cc_text}"
    return "ok", f"GPU compute capability {m.cc_text} has fp8 tensor cores"


def _compile(m: _Machine) -> Check:
    if m.gpus:
        if m.versions.get("triton"):
            return "ok", f"inductor with triton {m.versions['triton']}"
        return "unsupported", "inductor needs triton on GPU: pip install triton"
    if m.c_compiler:
        return "ok", f"inductor C++ backend with {m.c_compiler}; the first call compiles (tens of s)"
    return "unsupported", "inductor on CPU needs a C++ compiler (g++/clang); none on PATH"


def _flash_attention(m: _Machine) -> Check:
    if not m.gpus:
        return "unsupported", "needs CUDA and the flash_attn package; no GPU here"
    if not m.cc_at_least(8):
        return "unsupported", f"flash-attention 2 needs compute capability >= 8.0; this GPU is {m.cc_text}"
    if not m.versions.get("flash_attn"):
        return "unsupported", "the flash_attn package is not installed"
    return "ok", f"flash_attn {m.versions['flash_attn']}"


def _sdpa(m: _Machine) -> Check:
    return "ok", "torch's scaled_dot_product_attention picks the best kernel for the device"


def _torchao(m: _Machine, what: str) -> Check:
    if not m.versions.get("torchao"):
        return "unsupported", "torchao is not installed: pip install torchao"
    if m.gpus:
        return "ok", f"torchao {m.versions['torchao']}"
    return "ok", f"torchao {m.versions['torchao']}; {what} on CPU is often slower in eager mode: pair with compile"


def _int4(m: _Machine) -> Check:
    if not m.versions.get("torchao"):
        return "unsupported", "torchao is not installed: pip install torchao"
    if not m.gpus:
        return "unsupported", "torchao int4 weight-only uses CUDA's tinygemm kernel; no GPU here"
    if not m.cc_at_least(8):
        return "unsupported", f"tinygemm needs compute capability >= 8.0; this GPU is {m.cc_text}"
    return "ok", f"torchao {m.versions['torchao']} tinygemm int4 kernel"


def _tf32(m: _Machine) -> Check:
    if not m.gpus:
        return "unsupported", "TF32 is a GPU tensor-core mode; no GPU here"
    if not m.cc_at_least(8):
        return "unsupported", f"TF32 needs compute capability >= 8.0; this GPU is {m.cc_text}"
    return "ok", "fp32 matmuls on TF32 tensor cores (10-bit mantissa)"


def _cudnn_benchmark(m: _Machine) -> Check:
    if not m.gpus:
        return "unsupported", "cuDNN autotuning is GPU only; no GPU here"
    return "ok", "autotunes convolutions per input shape (fixed shapes only)"


def _channels_last(m: _Machine) -> Check:
    return "ok", "memory format for convolutions; measure it, it can be slower for some models"


def _multi_gpu(m: _Machine) -> Check:
    if m.gpus >= 2:
        return "ok", f"{m.gpus} GPUs for device_map / data-parallel"
    return "unsupported", f"needs 2+ GPUs, found {m.gpus}; CPU/disk offload still works"


def _offload(m: _Machine) -> Check:
    return "ok", "accelerate device_map with max_memory, CPU or disk offload"


def _int8_operator(dtype: torch.dtype) -> Callable[[_Machine], Check]:
    """The serving engine's own int8 GEMM for `dtype` activations (`accelab.ops.int8_gemm`)."""

    def check(m: _Machine) -> Check:
        kernel = int8_gemm.for_dtype(dtype)
        assert kernel is not None
        why = kernel.available(64, 64)
        if why is not None:
            return "unsupported", f"the {kernel.name} operator does not run here: {why}"
        return "ok", f"the {kernel.name} operator runs here (the serving engine's int8 plans)"

    return check


def _package(dist: str, name: str, pip: str, note: str = "") -> Callable[[_Machine], Check]:
    def check(m: _Machine) -> Check:
        version = m.versions.get(dist)
        if version:
            return "ok", f"{name} {version}{note}"
        return "unsupported", f"{name} is not installed: pip install {pip}"

    return check


def _probed(technique: str, fallback: Callable[[_Machine], Check]) -> Callable[[_Machine], Check]:
    """The probe's measured factor when there is one (`accelab.measure.probes`), else `fallback`.
    A probe measured under noise is reported, never used as the verdict; "slow" needs the whole
    interval below SLOW_BELOW (a probe cached before intervals: its factor alone)."""

    def check(m: _Machine) -> Check:
        status, reason = fallback(m)
        factor = m.limits.probes.get(technique) if m.limits is not None else None
        if status == "unsupported" or factor is None:
            return status, reason
        detail = m.limits.probe_details.get(technique) if m.limits is not None else None
        if detail is not None and not detail.get("trusted", True):
            return status, (
                f"{describe(factor, technique=technique)}, but under noise ({detail.get('reason')}): not used as a "
                f"verdict (`accelab env --refresh` on a quiet machine measures it again); {reason}"
            )
        high = detail.get("high") if detail else None
        if (high if high is not None else factor) < SLOW_BELOW:
            return "slow", f"{describe(factor, detail, technique)}: expect it slower than fp32"
        return "ok", describe(factor, detail, technique)

    return check


# Technique names follow Plan's fields (precision, quantization, backend, ...).
CHECKS: dict[str, Callable[[_Machine], Check]] = {
    "bf16-autocast": _probed("bf16-autocast", _bf16),
    "bf16-weights": _probed("bf16-weights", _bf16),
    "fp16-autocast": _fp16_autocast,
    "fp16-weights": _probed("fp16-weights", _fp16_weights),
    "fp8": _fp8,
    "tf32": _tf32,
    "compile": _compile,
    "sdpa": _sdpa,
    "flash_attention_2": _flash_attention,
    "int8-weight": _probed("int8-weight", lambda m: _torchao(m, "int8 weight-only")),
    "int8-dynamic": _probed("int8-dynamic", lambda m: _torchao(m, "int8 dynamic")),
    "int4-weight": _int4,
    # the serving engine's int8 plans: its own operators, not torchao's eager kernels
    "int8-gemm-f32": _probed("int8-gemm-f32", _int8_operator(torch.float32)),
    "int8-gemm-bf16": _probed("int8-gemm-bf16", _int8_operator(torch.bfloat16)),
    "channels_last": _channels_last,
    "cudnn-benchmark": _cudnn_benchmark,
    "multi-gpu": _multi_gpu,
    "offload": _offload,
    "onnxruntime": _package("onnxruntime", "ONNX Runtime", "onnxruntime"),
    "openvino": _package("openvino", "OpenVINO", "openvino"),
    "llamacpp": _package("llama_cpp", "llama.cpp", "llama-cpp-python", " (GGUF models)"),
    "vllm": lambda m: _vllm(),
    "openvino-genai": lambda m: _openvino_genai(),
}


def _vllm() -> Check:
    """vLLM runs from its own venv (accelab.backends.vllm_launch), so the versions of this one say nothing."""
    install, reason = find_vllm()
    if install is None:
        return "unsupported", reason
    return "ok", f"{install.describe()} (its own process; text-generation checkpoints)"


def _openvino_genai() -> Check:
    """backend openvino's text generation runs from its own venv (accelab.backends.openvino_genai)."""
    install, reason = find_genai()
    if install is None:
        return "unsupported", reason
    return "ok", f"{install.describe()} (its own process; backend openvino on text-generation checkpoints)"


def capabilities(env: dict[str, Any], limits: HardwareLimits | None = None) -> list[Capability]:
    """What each technique can do on the machine `env` describes (see environment()).

    With CPU `limits`, bf16 is judged by the measured bf16/fp32 matmul rates rather than by
    instruction-set flags."""
    machine = _Machine.of(env, limits)
    result = []
    for name, check in CHECKS.items():
        status, reason = check(machine)
        result.append(Capability(technique=name, status=status, reason=reason))
    return result


def plan_techniques(plan: Any) -> list[str]:
    """The capability-report names of what `plan` changes from fp32 eager torch."""
    used = [plan.precision] if plan.precision != "fp32" else []
    used += ["compile"] if plan.compile != "off" else []
    used += [plan.quantization] if plan.quantization != "none" else []
    used += [plan.backend] if plan.backend != "torch" else []
    used += ["channels_last"] if plan.memory_format == "channels_last" else []
    return used


def slow_techniques(device: Any, *, measure: bool = False) -> dict[str, str]:
    """Techniques the capability report expects slower than fp32 eager on `device`, with why:
    from the probes and peaks of `accelab env` (measured now when `measure`, else only when
    cached), or from instruction-set flags when nothing was measured."""
    env = environment()
    if device.type == "cpu" and env.get("gpus"):
        return {}  # the report judges this machine's GPUs, not its CPU
    limits = None
    if device.type == "cpu":
        limits = hardware.hardware_limits("cpu") if measure else hardware.cached_limits("cpu")  # tests replace them
    return {c.technique: c.reason for c in capabilities(env, limits) if c.status == "slow"}


def bf16_outruns_fp32(device: Any) -> str | None:
    """Why bf16 is the precision to serve int8 plans in on `device` (bf16 measured at least as fast
    as fp32 by `accelab env`'s probe, or, unmeasured, a CPU with AMX), else None: a CPU where the
    float32 twins of the bf16 plans are the ones that can win."""
    if device.type != "cpu" or environment().get("gpus"):
        return None
    limits = hardware.cached_limits("cpu")
    factor = limits.probes.get("bf16-weights") if limits is not None else None
    detail = (limits.probe_details.get("bf16-weights") or {}) if limits is not None else {}
    if factor is not None and detail.get("trusted", True):
        low = detail.get("low")
        return f"bf16 weights {describe(factor, detail)}" if (factor if low is None else low) >= 1.0 else None
    if cpu.has("amx_tile", "amx_bf16"):
        return "this CPU has AMX (bf16 tiles); `accelab env` has not measured it"
    return None
