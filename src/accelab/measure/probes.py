"""One small timed probe per technique whose speed depends on the CPU: what it does to a
transformer MLP (768 -> 3072 -> 768, GELU, 32 tokens) against fp32 eager on the same machine,
as a factor (2.0 = twice as fast, 0.15 = about seven times slower). Measured with the hardware
limits and cached with them, so `accelab env`, compare, tune and train --bench can say "slow
(0.15x fp32)" before they spend minutes finding out.

The probe runs what the plan's technique runs: autocast for bf16-autocast, bf16 weights for
bf16-weights, and torchao's configs (the same `make_config`) for the int8 plans. The serving
engine's own int8 operators (`accelab.ops.int8_gemm`) get probes of their own, where they run:
"int8-gemm-f32" (AVX2, float32 activations) and "int8-gemm-bf16" (AMX), each on a decoding step's
GEMMs (GEMM_TOKENS rows) against the float GEMMs the engine would run instead (oneDNN on packed
float32 weights, as `serve/engines/llama_stack` packs them). The serving tune prunes by them, and
the engine keeps the dequantized weight where its operator measured slow.

A busy minute must not become a verdict: the technique and fp32 take turns in short rounds
(fp32, technique; technique, fp32; ...), the machine's noise is measured around each turn, and
the factor is the paired ratio of the rounds (`accelab.measure.paired`) over the quiet ones.
Rounds go on until its interval is within +-TARGET_HALF_WIDTH or MAX_ROUNDS ran. A probe with
too few quiet rounds is kept, marked untrusted, and is never used as a verdict (`capabilities`
falls back to what the CPU's flags say, and says why). A technique is "slow" only when its
whole interval is below SLOW_BELOW.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from accelab.measure import kernels, noise
from accelab.measure.paired import Ratio, paired_ratio, relative_half_width
from accelab.ops import int8_gemm
from accelab.plan.techniques.quantization import make_config

log = logging.getLogger(__name__)

TOKENS, HIDDEN = 32, 768
GEMM_TOKENS = 8  # a decoding step of 8 sequences: the rows of the int8 operators' probes
INT8_GEMM: dict[str, torch.dtype] = {"int8-gemm-f32": torch.float32, "int8-gemm-bf16": torch.bfloat16}
SLOW_BELOW = 0.8  # a technique probed below this factor is reported "slow"
MIN_ROUNDS, MAX_ROUNDS = 4, 16
TARGET_HALF_WIDTH = 0.05  # stop when the factor is known within +-5%
REPEATS = 3  # calls per turn at least; a turn's time is the best of them
TURN_S = 0.2  # ... and as many as fill this long: a shorter noise window says little (noise.window)


def _mlp() -> torch.nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(HIDDEN, 4 * HIDDEN), torch.nn.GELU(), torch.nn.Linear(4 * HIDDEN, HIDDEN)
        ).eval()


def _variant(technique: str, device: torch.device) -> tuple[torch.nn.Module, torch.dtype, Callable[[], Any]]:
    """(the model under the technique, its input dtype, the context its calls run in)."""
    model = _mlp().to(device)
    if technique == "bf16-autocast":
        return model, torch.float32, lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    if technique in ("bf16-weights", "fp16-weights"):
        dtype = torch.bfloat16 if technique.startswith("bf16") else torch.float16
        return model.to(dtype), dtype, nullcontext
    if technique in ("int8-weight", "int8-dynamic"):
        from torchao.quantization import quantize_

        quantize_(model, make_config(technique, device))
        return model, torch.float32, nullcontext
    return model, torch.float32, nullcontext  # "fp32": the reference


def techniques(device: torch.device) -> list[str]:
    names = ["bf16-autocast", "bf16-weights", "fp16-weights"]
    if importlib.util.find_spec("torchao") is not None:
        names += ["int8-weight", "int8-dynamic"]
    names += [name for name, dtype in INT8_GEMM.items() if int8_gemm.available(64, 64, dtype) is None]
    return names if device.type == "cpu" else []  # GPUs: the capability checks know their tensor cores


class _Gemms(torch.nn.Module):
    """The MLP's two GEMMs as the serving engine runs them: int8 through an operator of
    `accelab.ops.int8_gemm` (`dtype`: its activations), or float32 weights packed for oneDNN."""

    def __init__(self, mlp: torch.nn.Sequential, dtype: torch.dtype | None):
        super().__init__()
        self.layers = [self._bind(mlp[0], dtype), self._bind(mlp[2], dtype)]

    @staticmethod
    def _bind(linear: torch.nn.Module, dtype: torch.dtype | None) -> Callable[[torch.Tensor], torch.Tensor]:
        assert isinstance(linear, torch.nn.Linear)
        weight, bias = linear.weight.detach(), linear.bias.detach()
        if dtype is None:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, GEMM_TOKENS)
            return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        kernel = int8_gemm.for_dtype(dtype)
        assert kernel is not None
        scales = weight.abs().amax(1).clamp(min=1e-8) / 127  # one scale a row, as torchao's int8 weight-only
        values = torch.round(weight / scales[:, None]).to(torch.int8)
        return kernel.bind(values, scales, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](F.gelu(self.layers[0](x)))


def _call(technique: str, device: torch.device) -> Callable[[], Any]:
    if technique in INT8_GEMM or technique == "fp32-packed":
        dtype = INT8_GEMM.get(technique)
        gemms = _Gemms(_mlp(), dtype)
        x = torch.randn(GEMM_TOKENS, HIDDEN).to(dtype or torch.float32)
        return lambda: gemms(x)
    model, dtype, context = _variant(technique, device)
    x = torch.randn(TOKENS, HIDDEN, device=device).to(dtype)

    def call() -> Any:
        with torch.inference_mode(), context():
            return model(x)

    return call


def _reference(technique: str) -> str:
    """What a technique is measured against: fp32 eager, or for the int8 operators the float32
    GEMMs the serving engine runs without them."""
    return "fp32-packed" if technique in INT8_GEMM else "fp32"


@dataclass(frozen=True, kw_only=True, slots=True)
class Probe:
    """One technique against fp32: the factor, its interval, and how quiet the machine was."""

    factor: float | None
    low: float | None
    high: float | None
    rounds: int
    dropped: int
    trusted: bool  # enough quiet rounds: the factor may be used as a verdict
    noise: str  # quiet | noisy | unreliable: the loudest round the factor kept
    reason: str  # the interval, or why the probe is not trusted

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def slow(self) -> bool:
        return self.trusted and self.high is not None and self.high < SLOW_BELOW


def probe(technique: str, device: torch.device) -> Probe:
    """The technique and fp32 in alternating rounds until the factor is stable (module docstring)."""
    reference = _reference(technique)
    calls = {"fp32": _call(reference, device), technique: _call(technique, copy.copy(device))}
    rates: dict[str, list[float]] = {name: [] for name in calls}
    windows: dict[str, list[noise.Window | None]] = {name: [] for name in calls}
    ratio: Ratio | None = None
    repeats = {name: _repeats(call, device) for name, call in calls.items()}
    for r in range(MAX_ROUNDS):
        for name in ("fp32", technique) if r % 2 == 0 else (technique, "fp32"):
            with noise.Meter() as meter:
                seconds = kernels.best_seconds(calls[name], device, repeats=repeats[name])
            rates[name].append(1.0 / seconds)
            windows[name].append(meter.window)
        usable = [_usable(a) and _usable(b) for a, b in zip(windows["fp32"], windows[technique])]
        ratio = paired_ratio(rates[technique], rates["fp32"], usable)
        width = relative_half_width(ratio)
        if r + 1 >= MIN_ROUNDS and width is not None and width <= TARGET_HALF_WIDTH:
            break
    assert ratio is not None
    kept = [w for pair in zip(windows["fp32"], windows[technique]) if all(_usable(w) for w in pair) for w in pair]
    loud = noise.worst([w for w in (*windows["fp32"], *windows[technique]) if w is not None])
    level = max((w.level for w in kept if w is not None), key=noise.LEVELS.index, default="quiet")
    if ratio.value is None:
        why = f"{ratio.reason}; loudest: {loud.reason}" if loud is not None and loud.reason else ratio.reason
        return Probe(
            factor=_plain_factor(rates, technique),
            low=None,
            high=None,
            rounds=ratio.rounds,
            dropped=ratio.dropped,
            trusted=False,
            noise="unreliable",
            reason=why,
        )
    return Probe(
        factor=ratio.value,
        low=ratio.low,
        high=ratio.high,
        rounds=ratio.rounds,
        dropped=ratio.dropped,
        trusted=True,
        noise=level,
        reason=f"{ratio.low:.2f}-{ratio.high:.2f}, {ratio.rounds} rounds",
    )


def _repeats(call: Callable[[], Any], device: torch.device) -> int:
    """Calls per turn: at least REPEATS, and enough to fill TURN_S."""
    one = kernels.best_seconds(call, device, repeats=1)
    return max(REPEATS, math.ceil(TURN_S / max(one, 1e-6)))


def _usable(w: noise.Window | None) -> bool:
    return w is None or w.level != "unreliable"


def _plain_factor(rates: dict[str, list[float]], technique: str) -> float:
    """The untrusted probe's figure, for the record: best technique rate over best fp32 rate."""
    return max(rates[technique]) / max(rates["fp32"])


def probe_all(device: torch.device) -> dict[str, Probe]:
    """{technique: Probe against fp32 eager}; a technique that fails here is left out."""
    found: dict[str, Probe] = {}
    for technique in techniques(device):
        try:
            found[technique] = probe(technique, device)
        except Exception as err:  # noqa: BLE001 - a probe that cannot run says nothing
            log.info("probe %s skipped: %s", technique, err)
            continue
        p = found[technique]
        log.info(
            "probe %s on %s: %.2fx fp32 eager (%s%s)",
            technique,
            device,
            p.factor or 0,
            p.reason,
            "" if p.trusted else "; not trusted",
        )
    return found


def describe(factor: float, detail: dict[str, Any] | None = None, technique: str = "") -> str:
    interval = ""
    if detail and detail.get("low") is not None:
        interval = f" ({detail['low']:.2f}-{detail['high']:.2f}, {detail.get('rounds')} rounds, {detail.get('noise')})"
    if technique in INT8_GEMM:
        return f"measured {factor:.2f}x the float32 GEMMs{interval} on a decoding step's MLP ({GEMM_TOKENS} rows) here"
    return f"measured {factor:.2f}x fp32 eager{interval} on a transformer MLP here"
