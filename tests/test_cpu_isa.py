"""ACCELAB_CPU_ISA: a bigger CPU takes a smaller one's paths. accelab's reading of the CPU's flags,
oneDNN's and torch's kernels are capped alike, in this process and in the ones it starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from accelab import cpu

pytestmark = pytest.mark.cpu_kind  # its path depends on the CPU (make test-avx2)

AMX_HOST = frozenset({"sse4_2", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                      "amx_tile", "amx_bf16", "amx_int8", "avx_vnni"})  # fmt: skip


@pytest.fixture
def amx_host(monkeypatch):
    """The flags of an AMX Xeon, whatever this machine is (a stand-in for /proc/cpuinfo)."""
    monkeypatch.setattr(cpu, "host_flags", lambda: AMX_HOST)
    monkeypatch.delenv(cpu.ENV, raising=False)


def test_unset_the_flags_are_the_hosts(amx_host):
    assert cpu.flags() == AMX_HOST
    assert cpu.current() == "amx" and cpu.native_bf16() and cpu.described() == "amx"
    assert cpu.march() == ["-march=native"]


@pytest.mark.parametrize(
    ("level", "kept", "gone", "native_bf16"),
    [
        ("avx2", {"avx2", "fma", "sse4_2"}, {"avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "avx_vnni"}, False),
        ("avx512", {"avx2", "avx512f", "avx512_vnni", "avx_vnni"}, {"avx512_bf16", "avx512_fp16", "amx_tile"}, False),
        ("avx512_bf16", {"avx512f", "avx512_bf16"}, {"avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"}, True),
        ("amx", set(AMX_HOST), set(), True),
    ],
)
def test_each_level_keeps_the_flags_at_or_below_it(amx_host, monkeypatch, level, kept, gone, native_bf16):
    monkeypatch.setenv(cpu.ENV, level)
    assert kept <= cpu.flags() and not gone & cpu.flags()
    assert cpu.current() == level
    assert cpu.native_bf16() is native_bf16
    assert cpu.described() == f"{level} (capped by ACCELAB_CPU_ISA={level})"


def test_a_level_never_adds_what_the_cpu_lacks(monkeypatch):
    monkeypatch.setattr(cpu, "host_flags", lambda: frozenset({"avx2", "fma"}))
    monkeypatch.setenv(cpu.ENV, "amx")
    assert cpu.current() == "avx2" and not cpu.native_bf16()


def test_an_unknown_level_is_refused_with_the_choices(monkeypatch):
    monkeypatch.setenv(cpu.ENV, "avx1024")
    with pytest.raises(ValueError, match=r"ACCELAB_CPU_ISA='avx1024' is not a CPU level; use one of avx2, avx512"):
        cpu.flags()


def test_the_override_caps_onednn_and_torch_and_keeps_a_users_own_setting(monkeypatch):
    for name in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(cpu.ENV, "avx2")
    cpu.apply_override()
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2" and os.environ["ATEN_CPU_CAPABILITY"] == "avx2"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")
    monkeypatch.setenv(cpu.ENV, "avx512_bf16")
    cpu.apply_override()
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE"  # the user's
    assert os.environ["ATEN_CPU_CAPABILITY"] == "avx2"  # set before: setdefault keeps it


def test_a_process_that_imports_accelab_runs_torch_at_the_level():
    """A new process: `import accelab` before torch sets both variables, torch dispatches to the
    level's kernels, and the capability report names the level and the override."""
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")}
    code = (
        "import json, os, accelab, torch\n"
        "from accelab.measure.environment import cpu_capability\n"
        "c = cpu_capability()\n"
        "print(json.dumps([os.environ['ONEDNN_MAX_CPU_ISA'], torch.backends.cpu.get_cpu_capability(),"
        " c['level'], c['native_bf16'], c['flags'].get('avx512f', False), c['torch_amx_tile']]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        env={**env, cpu.ENV: "avx2"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    onednn, capability, level, bf16, avx512, amx = json.loads(out.stdout.splitlines()[-1])
    assert onednn == "AVX2" and capability in ("AVX2", "DEFAULT")
    assert level == "avx2 (capped by ACCELAB_CPU_ISA=avx2)"
    assert bf16 is False and avx512 is False and not amx


def test_the_kernels_build_for_the_level_and_apart_from_the_cpus_own(amx_host, monkeypatch):
    from accelab.ops import loader as kernels

    own = kernels.library_path("lib", "source")
    assert "-march=native" in kernels.flags()
    monkeypatch.setenv(cpu.ENV, "avx2")
    assert "-march=x86-64-v3" in kernels.flags() and "-march=native" not in kernels.flags()
    assert kernels.library_path("lib", "source") != own  # a build of its own, never the native one
    assert "amx_tile" not in kernels.cpu_flags()
