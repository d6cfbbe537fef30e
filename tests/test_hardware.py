"""Environment, fingerprint, measured hardware limits and their cache, capabilities, `accelab env`."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import typer
from typer.testing import CliRunner

from accelab.measure import hardware, kernels, noise, probes
from accelab.measure.capabilities import capabilities
from accelab.measure.environment import environment, fingerprint
from accelab.measure.hardware import HardwareLimits, hardware_limits

# the probes measure this machine's peaks and techniques: with nothing beside them (tests/conftest.py)
pytestmark = pytest.mark.alone

ENV_KEYS = {
    "hostname",
    "cpu_model",
    "physical_cores",
    "logical_cores",
    "available_cores",
    "cpu",
    "ram_total_bytes",
    "gpus",
    "driver_version",
    "versions",
    "torch_threads",
    "c_compiler",
}


@pytest.fixture(scope="module")
def env() -> dict:
    return environment()


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> tuple[HardwareLimits, str]:
    """Real CPU limits measured once into a private cache (shared by the tests that read it)."""
    cache = str(tmp_path_factory.mktemp("accelab-cache"))
    old = os.environ.get("ACCELAB_CACHE")
    os.environ["ACCELAB_CACHE"] = cache
    try:
        yield hardware_limits("cpu"), cache
    finally:
        if old is None:
            os.environ.pop("ACCELAB_CACHE", None)
        else:
            os.environ["ACCELAB_CACHE"] = old


# --- environment and fingerprint ----------------------------------------------------------


def test_environment_has_the_keys(env):
    assert ENV_KEYS <= env.keys()
    assert env["logical_cores"] >= env["available_cores"] >= 1
    assert env["ram_total_bytes"] > 2**30
    assert env["versions"]["torch"] == torch.__version__
    assert env["versions"]["python"].count(".") == 2
    assert env["torch_threads"]["intra_op"] == torch.get_num_threads()
    assert {"torch_capability", "native_bf16", "torch_amx_tile"} <= env["cpu"].keys()
    json.dumps(env)  # it goes into every Result


def test_fingerprint_is_stable_and_tracks_what_makes_results_comparable(env):
    fp = fingerprint(env)
    assert fp == fingerprint(environment()) == fingerprint(copy.deepcopy(env))
    assert len(fp) == 12

    newer_torch = copy.deepcopy(env)
    newer_torch["versions"]["torch"] = "9.9.9"
    assert fingerprint(newer_torch) != fp

    other_gpu = copy.deepcopy(env)
    other_gpu["gpus"] = [{"name": "NVIDIA H200"}]
    assert fingerprint(other_gpu) != fp

    other_host = copy.deepcopy(env)
    other_host["hostname"] = "node-2"  # an identical node compares as equal
    other_host["versions"]["onnxruntime"] = "0.0.1"  # not part of the comparison
    assert fingerprint(other_host) == fp


# --- measured limits and the cache ---------------------------------------------------------


@pytest.mark.slow
def test_measured_limits_are_plausible(measured):
    limits, _ = measured
    assert limits.device == "cpu"
    assert limits.threads == torch.get_num_threads()
    assert 1e9 < limits.fp32_flops < 1e13
    assert 1e7 < limits.bf16_flops < 1e13
    assert limits.tf32_flops is None
    assert 1e9 < limits.bandwidth_bytes_per_s < 1e12


def test_second_call_reads_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("ACCELAB_CACHE", str(tmp_path))
    monkeypatch.setattr(noise, "snapshot", lambda pids=(): None)  # no noise readings: every probe is trusted
    calls = []

    def fake_best_seconds(fn, device, *, repeats, inner=1):
        calls.append(repeats)
        return 0.5  # no work: this test is about the cache, not the numbers

    monkeypatch.setattr(kernels, "best_seconds", fake_best_seconds)
    assert hardware.cached_limits("cpu") is None  # nothing measured yet, and it does not measure
    assert calls == []
    first = hardware_limits("cpu")
    measured_calls = len(calls)
    assert measured_calls >= 3 * 7 + 3  # 3 paths x 7 kernels, 3 bandwidth kernels (and the probes)
    assert (tmp_path / "hardware.json").exists()

    second = hardware_limits("cpu")
    assert len(calls) == measured_calls  # not measured again
    assert second == first == hardware.cached_limits("cpu")

    hardware_limits("cpu", refresh=True)
    assert len(calls) == 2 * measured_calls


def test_limits_measured_under_noise_are_measured_again_only_when_it_is_quiet(monkeypatch, tmp_path):
    monkeypatch.setenv("ACCELAB_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "best_seconds", lambda fn, device, *, repeats, inner=1: 0.5)
    loud = noise.Window(seconds=1.0, steal=0.31, others_cores=0.0, throttled=0.0, load1=3.0)
    quiet = noise.Window(seconds=1.0, steal=0.0, others_cores=0.0, throttled=0.0, load1=0.1)
    now = {"window": loud}

    class FakeMeter:  # every window the measurement sees is as loud as `now` says
        def __init__(self, pids=()):
            self.window = None

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.window = now["window"]

    monkeypatch.setattr(noise, "Meter", FakeMeter)
    monkeypatch.setattr(noise, "sample_now", lambda seconds=1.0: now["window"])
    first = hardware_limits("cpu")
    assert not first.trusted and first.noise["level"] == "unreliable" and first.noise["reason"] == "31% CPU steal"
    assert all(not d["trusted"] and d["low"] is None for d in first.probe_details.values())
    assert first.probes  # the untrusted factors are kept, for the record
    assert hardware_limits("cpu").measured_at == first.measured_at  # still loud: the marked entry is kept
    now["window"] = quiet
    again = hardware_limits("cpu")  # quiet now: measured again, and trusted this time
    assert again.trusted and again.noise["level"] == "quiet"
    assert all(d["trusted"] and d["low"] == d["high"] == 1.0 for d in again.probe_details.values())
    assert hardware.cached_limits("cpu") == again


def test_cache_is_keyed_by_thread_count(monkeypatch, tmp_path):
    monkeypatch.setenv("ACCELAB_CACHE", str(tmp_path))
    monkeypatch.setattr(noise, "snapshot", lambda pids=(): None)
    monkeypatch.setattr(kernels, "best_seconds", lambda fn, device, *, repeats, inner=1: 0.5)
    threads = torch.get_num_threads()
    hardware_limits("cpu")
    try:
        torch.set_num_threads(1)
        hardware_limits("cpu")
    finally:
        torch.set_num_threads(threads)
    keys = json.loads((tmp_path / "hardware.json").read_text()).keys()
    assert {key.rsplit("|", 1)[1] for key in keys} == {f"threads={threads}", "threads=1"}


def test_fake_timing_gives_the_arithmetic(monkeypatch, tmp_path):
    # 0.5 s per call: each figure is the best kernel's work / 0.5 s
    monkeypatch.setattr(kernels, "best_seconds", lambda fn, device, *, repeats, inner=1: 0.5)
    band = kernels.bandwidth(torch.device("cpu"), nbytes=2**20)
    assert band.value == pytest.approx(3 * 2**20 / 0.5) and band.kernel.startswith("triad")  # STREAM counts 3 arrays
    peak = kernels.peak_flops("fp32", torch.device("cpu"))
    # every call "takes" 0.5 s: the kernels shrink 8x, and the most work per call wins
    assert peak.value == pytest.approx(2.0 * 64 * 3072 * 768 / 0.5) and peak.kernel == "linear 64x768->3072"


@pytest.mark.slow
def test_peaks_are_measured_on_the_kernels_models_run(measured):
    """The fp32 peak is the best of Linear, conv and matmul: never below what a plain Linear
    of a transformer's shape reaches on this machine (its MFU would pass 100%)."""
    limits, _ = measured
    assert {"fp32", "bf16", "bf16-autocast", "bandwidth"} <= limits.kernels.keys()
    x, w = torch.randn(256, 768), torch.randn(3072, 768)
    seconds = kernels.best_seconds(lambda: torch.nn.functional.linear(x, w), torch.device("cpu"), repeats=5)
    assert 2 * 256 * 768 * 3072 / seconds < 1.25 * limits.fp32_flops  # a margin for a noisy machine
    assert limits.peak_for("bf16-autocast") == ("bf16-autocast", limits.bf16_autocast_flops)
    assert limits.peak_for("bf16-weights") == ("bf16", limits.bf16_flops)
    assert limits.peak_for("fp32") == ("fp32", limits.fp32_flops)


@pytest.mark.slow
def test_bandwidth_agrees_with_an_independent_numpy_copy(measured):
    """Stated band: numpy's copy (2 bytes moved per byte copied, over 512 MiB) lands within
    0.5x-1.5x of the measured figure (the best of read, copy and triad)."""
    import time

    import numpy as np

    limits, _ = measured
    source = np.ones(2**27, dtype=np.float32)  # 512 MiB, past any cache here
    target = np.empty_like(source)
    best = min(_timed(lambda: np.copyto(target, source), time) for _ in range(5))
    numpy_rate = 2 * source.nbytes / best
    assert 0.5 * limits.bandwidth_bytes_per_s < numpy_rate < 1.5 * limits.bandwidth_bytes_per_s, (
        numpy_rate / 1e9,
        limits.bandwidth_bytes_per_s / 1e9,
    )


def _timed(fn, time) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@pytest.mark.slow
def test_probes_time_each_technique_against_fp32(measured, env):
    limits, _ = measured
    names = set(probes.techniques(torch.device("cpu")))
    assert {"bf16-autocast", "bf16-weights"} <= names <= set(limits.probes) | {"fp16-weights"}
    assert all(0.001 < factor < 100 for factor in limits.probes.values())
    caps = _by_name(capabilities(env, limits))
    factor = limits.probes["bf16-autocast"]
    assert f"measured {factor:.2f}x fp32 eager" in caps["bf16-autocast"].reason
    _assert_follows_the_probe(caps["bf16-autocast"], limits.probe_details["bf16-autocast"])


def _assert_follows_the_probe(cap, detail: dict) -> None:
    """The documented rule: a trusted probe is the verdict ("slow" only with its whole interval
    below SLOW_BELOW); one measured under noise is reported and never used as the verdict."""
    if detail["trusted"]:
        assert detail["low"] <= detail["factor"] <= detail["high"]
        assert cap.status == ("slow" if detail["high"] < probes.SLOW_BELOW else "ok")
        assert ("expect it slower" in cap.reason) == (detail["high"] < probes.SLOW_BELOW)
        assert f"({detail['low']:.2f}-{detail['high']:.2f}, {detail['rounds']} rounds" in cap.reason
    else:
        assert "but under noise" in cap.reason and "not used as a verdict" in cap.reason


def test_cuda_on_a_cpu_machine_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="no GPU"):
        hardware_limits("cuda")


# --- capabilities ---------------------------------------------------------------------------


def _by_name(caps) -> dict:
    return {cap.technique: cap for cap in caps}


@pytest.mark.slow
def test_capabilities_on_this_cpu(env, measured):
    if env["gpus"]:
        pytest.skip("this machine has a GPU")
    limits, _ = measured
    caps = _by_name(capabilities(env, limits))
    assert caps["fp16-autocast"].status == "unsupported"
    assert "no-op" in caps["fp16-autocast"].reason
    assert caps["tf32"].status == "unsupported"
    assert caps["fp8"].status == "unsupported"
    assert caps["flash_attention_2"].status == "unsupported"
    assert caps["int4-weight"].status == "unsupported"
    assert caps["channels_last"].status == "ok"
    # the report says what the probe measured on this machine, whichever way it went
    for technique in ("bf16-autocast", "bf16-weights", "int8-dynamic", "int8-weight"):
        factor = limits.probes[technique]
        assert f"measured {factor:.2f}x fp32" in caps[technique].reason
        _assert_follows_the_probe(caps[technique], limits.probe_details[technique])


def _cpu_env(**cpu) -> dict:
    return {
        "cpu": {"native_bf16": False, "native_fp16": False, "torch_amx_tile": False, **cpu},
        "gpus": [],
        "versions": {"torchao": "0.18.0", "onnxruntime": None},
        "c_compiler": "/usr/bin/gcc",
    }


def test_bf16_without_native_support_is_slow_with_the_reason():
    caps = _by_name(capabilities(_cpu_env()))
    assert caps["bf16-autocast"].status == "slow"
    assert "no native bf16" in caps["bf16-autocast"].reason
    assert _by_name(capabilities(_cpu_env(native_bf16=True, torch_amx_tile=True)))["bf16-autocast"].status == "ok"


def test_a_probe_is_a_verdict_only_when_trusted_and_its_whole_interval_decides():
    env = _cpu_env(native_bf16=True, torch_amx_tile=True)  # the flags alone would say "ok"

    def cap(**detail):
        limits = HardwareLimits(
            device="cpu",
            fp32_flops=300e9,
            bf16_flops=None,
            tf32_flops=None,
            bandwidth_bytes_per_s=20e9,
            threads=2,
            measured_at="",
            fingerprint="x",
            probes={"bf16-autocast": detail["factor"]},
            probe_details={"bf16-autocast": detail},
        )
        return _by_name(capabilities(env, limits))["bf16-autocast"]

    slow = cap(factor=0.5, low=0.45, high=0.55, rounds=6, noise="quiet", trusted=True)
    assert slow.status == "slow"
    assert slow.reason == (
        "measured 0.50x fp32 eager (0.45-0.55, 6 rounds, quiet) on a transformer MLP here: expect it slower than fp32"
    )
    straddles = cap(factor=0.75, low=0.6, high=0.9, rounds=16, noise="noisy", trusted=True)
    assert straddles.status == "ok"  # not known to be slow: tune measures it rather than pruning it
    noisy = cap(
        factor=0.66,
        low=None,
        high=None,
        rounds=1,
        noise="unreliable",
        trusted=False,
        reason="unreliable: 1 of 16 rounds were quiet enough to compare",
    )
    assert noisy.status == "ok" and noisy.reason.startswith(
        "measured 0.66x fp32 eager on a transformer MLP here, but under noise (unreliable: 1 of 16 rounds"
    )
    assert noisy.reason.endswith("torch sees AMX tiles on this CPU: native bf16 matmuls")


def test_measurement_overrides_the_flags():
    flags_say_native = _cpu_env(native_bf16=True, torch_amx_tile=True)
    limits = HardwareLimits(
        device="cpu",
        fp32_flops=300e9,
        bf16_flops=1e9,
        tf32_flops=None,
        bandwidth_bytes_per_s=20e9,
        threads=2,
        measured_at="",
        fingerprint="x",
    )
    cap = _by_name(capabilities(flags_say_native, limits))["bf16-autocast"]
    assert cap.status == "slow" and "1.0 GFLOP/s vs fp32 300.0" in cap.reason


def test_capabilities_on_a_fake_gpu_machine():
    gpu = {
        "name": "NVIDIA H200",
        "compute_capability": "9.0",
        "driver_version": "570",
        "memory_total_mb": 143000,
        "index": 0,
    }
    env = {
        "cpu": {"native_bf16": False},
        "gpus": [gpu, dict(gpu, index=1)],
        "versions": {"torchao": "0.18.0", "triton": "3.5.0", "flash_attn": None},
        "c_compiler": None,
    }
    caps = _by_name(capabilities(env))
    for technique in (
        "bf16-autocast",
        "fp16-autocast",
        "fp8",
        "tf32",
        "int4-weight",
        "compile",
        "cudnn-benchmark",
        "multi-gpu",
    ):
        assert caps[technique].status == "ok", caps[technique]
    assert caps["flash_attention_2"].status == "unsupported" and "not installed" in caps["flash_attention_2"].reason

    ampere = dict(env, gpus=[dict(gpu, compute_capability="8.0")])
    caps = _by_name(capabilities(ampere))
    assert caps["fp8"].status == "unsupported" and "8.9" in caps["fp8"].reason
    assert caps["multi-gpu"].status == "unsupported"


# --- the command --------------------------------------------------------------------------


@pytest.mark.slow
def test_env_command_writes_the_report(measured, tmp_path, monkeypatch):
    from accelab.measure.commands import register

    _, cache = measured
    monkeypatch.setenv("ACCELAB_CACHE", cache)  # already measured: the command reads the cache
    app = typer.Typer()
    register(app)

    @app.callback()
    def _root() -> None:  # a group, so that `env` is a subcommand as in accelab's cli
        pass

    out = tmp_path / "out.json"
    result = CliRunner().invoke(app, ["env", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "fp16-autocast" in result.output and "GFLOP/s" in result.output

    report = json.loads(out.read_text())
    assert report["fingerprint"] == fingerprint(report["environment"])
    assert report["limits"][0]["device"] == "cpu" and report["limits"][0]["fp32_flops"] > 1e9
    statuses = {cap["technique"]: cap["status"] for cap in report["capabilities"]}
    assert statuses["compile"] in {"ok", "unsupported"}
    assert set(statuses.values()) <= {"ok", "slow", "unsupported"}


def test_bench_never_prints_an_mfu_or_roofline_above_100_percent(monkeypatch):
    """Above the measured peak, bench measures the limits again (refresh); a figure still above
    100% is reported as unknown with the reason, never as an impossible number."""
    from types import SimpleNamespace

    from accelab.benchmark import child as engine
    from accelab.scenarios.workload import Workload

    layer = torch.nn.Linear(256, 256, bias=False)
    x = torch.randn(8, 256)
    flops = 2 * 8 * 256 * 256
    runnable = SimpleNamespace(
        plan=SimpleNamespace(precision="fp32", quantization="none"), weight_bytes=1e9, model=layer, forward=layer
    )

    def figures(peaks, runnable=runnable, metrics=None, bandwidths=(1e10,)):
        calls = []

        def limits(*args, refresh=False, **kwargs):
            calls.append(refresh)
            i = min(len(calls) - 1, len(peaks) - 1)
            return hardware.HardwareLimits(
                device="cpu",
                fp32_flops=peaks[i],
                bf16_flops=None,
                tf32_flops=None,
                bandwidth_bytes_per_s=bandwidths[min(len(calls) - 1, len(bandwidths) - 1)],
                threads=1,
                measured_at="now",
                fingerprint="fp",
                kernels={"fp32": "linear 512x768->3072", "bandwidth": "copy"},
            )

        monkeypatch.setattr(engine, "hardware_limits", limits)  # the name the bench child reads
        metrics = metrics or {"latency_ms": {"p50": 1.0}}  # flops per ms -> flops * 1000 FLOP/s achieved
        return engine._hardware_figures(runnable, x, Workload(), metrics, torch.device("cpu")), calls

    ok, calls = figures([flops * 1000 * 4])
    assert ok["flops_per_call"] == flops and ok["mfu"] == pytest.approx(0.25) and calls == [False]
    remeasured, calls = figures([flops * 1000 / 2, flops * 1000 * 2])  # a busy first measurement
    assert remeasured["mfu"] == pytest.approx(0.5) and calls == [False, True]
    unknown, calls = figures([flops * 1000 / 2])  # still above after measuring again
    assert "mfu" not in unknown and calls == [False, True]
    assert (
        unknown["mfu_unknown"].startswith("MFU unknown: the forward ran at")
        and "linear 512x768" in unknown["mfu_unknown"]
    )
    # torch's counter does not see int8 kernels: a quantised plan gets no MFU, not a tiny one
    quantised = SimpleNamespace(
        **{**vars(runnable), "plan": SimpleNamespace(precision="fp32", quantization="int8-dynamic")}
    )
    assert "mfu" not in figures([flops * 1000], runnable=quantised)[0]
    # decoding: 1 GB of weights per 50 ms step is 20 GB/s
    decode = Workload(scenario="generate")
    monkeypatch.setattr(
        engine,
        "hardware_limits",
        lambda *a, **k: hardware.HardwareLimits(
            device="cpu",
            fp32_flops=1e12,
            bf16_flops=None,
            tf32_flops=None,
            bandwidth_bytes_per_s=10e9,
            threads=1,
            measured_at="now",
            fingerprint="fp",
            kernels={"bandwidth": "copy, 256 MiB arrays"},
        ),
    )
    roof = engine._hardware_figures(runnable, x, decode, {"decode_step_s": 0.05}, torch.device("cpu"))
    assert "roofline" not in roof and "20.0 GB/s of weights" in roof["roofline_unknown"]
