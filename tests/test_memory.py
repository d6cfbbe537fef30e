"""PeakMemorySampler: peaks from fake and real RSS, CPU utilisation, thread lifecycle, GPU fakes."""

from __future__ import annotations

import mmap
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from accelab.measure.gpu import EMPTY_SAMPLE, GpuSample, NvmlGpu, gpu_inventory
from accelab.measure.memory import MiB, PeakMemorySampler, process_rss_reader


def fake_reader(values_mb: list[float]):
    """Returns the values in order (in bytes), then repeats the last one."""
    values = [int(v * MiB) for v in values_mb]
    calls = []

    def read() -> int:
        calls.append(None)
        return values[min(len(calls) - 1, len(values) - 1)]

    read.calls = calls
    return read


def _wait_until(predicate, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.005)


def test_fake_reader_peak_and_baseline():
    reader = fake_reader([100, 150, 900, 300, 200])
    with PeakMemorySampler(interval=0.001, rss_reader=reader) as sampler:
        _wait_until(lambda: len(reader.calls) >= 6)
    report = sampler.report
    assert report.baseline_rss_mb == 100
    assert report.peak_rss_mb == 900
    assert report.peak_delta_mb == 800
    assert report.samples == len(reader.calls)
    assert report.gpu_peak_allocated_mb is None and report.nvml_used_mb is None and report.power_w is None


def test_a_block_shorter_than_one_interval_still_gets_its_final_reading():
    reader = fake_reader([100, 700])
    with PeakMemorySampler(interval=10.0, rss_reader=reader) as sampler:
        pass
    assert sampler.report.peak_rss_mb == 700
    assert sampler.report.samples == 2  # enter and exit; the thread never woke up


def test_thread_stops_on_exit_and_does_not_spin():
    reader = fake_reader([100])
    sampler = PeakMemorySampler(interval=0.01, rss_reader=reader)
    with sampler:
        assert sampler.running
        time.sleep(0.2)
    assert not sampler.running
    assert not any(t.name == "accelab-memory-sampler" for t in threading.enumerate())
    # ~20 wake-ups in 0.2 s at 10 ms; a busy loop would read thousands of times
    assert len(reader.calls) < 60


def test_thread_stops_when_the_block_raises():
    sampler = PeakMemorySampler(interval=0.001, rss_reader=fake_reader([1]))
    with pytest.raises(KeyError):
        with sampler:
            raise KeyError("boom")
    assert not sampler.running
    assert sampler.report.peak_rss_mb == 1


def test_real_reader_sees_a_200mb_array():
    # Fresh anonymous pages from the kernel, not from malloc: an allocator that kept a freed
    # block resident (an earlier test's) could hand it back without RSS growing.
    with PeakMemorySampler(interval=0.005) as sampler:
        block = mmap.mmap(-1, 200 * MiB)
        np.frombuffer(block, dtype=np.uint8)[::4096] = 1  # touch every page: only then is it resident
        time.sleep(0.05)
        block.close()
    assert sampler.report.peak_rss_mb - sampler.report.baseline_rss_mb >= 150


def test_include_children_counts_a_child_process():
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; b = b'x' * (120 * 2**20); print(1, flush=True); time.sleep(30)"],
        stdout=subprocess.PIPE,
    )
    try:
        child.stdout.readline()  # the child's memory is resident now
        own = process_rss_reader()()
        with_children = process_rss_reader(include_children=True)()
    finally:
        child.kill()
        child.wait()
    assert (with_children - own) / MiB >= 100


def test_cpu_utilisation_of_a_busy_block():
    fake_cpu = iter([10.0, 11.5])  # 1.5 CPU-seconds over the block
    with PeakMemorySampler(rss_reader=fake_reader([1]), cpu_seconds_reader=lambda: next(fake_cpu)) as sampler:
        time.sleep(0.1)
    report = sampler.report
    assert 1.5 / report.seconds * 100 == pytest.approx(report.cpu_util_percent)
    assert report.cpu_util_percent > 100  # more than one core busy
    from accelab.measure.environment import available_cores

    assert report.cpu_util_fraction == pytest.approx(report.cpu_util_percent / 100 / available_cores())


def test_real_cpu_utilisation_of_a_spin_is_about_one_core():
    with PeakMemorySampler() as sampler:
        end = time.perf_counter() + 0.3
        while time.perf_counter() < end:  # one busy Python thread
            pass
    # CPU time over wall time: below 100 only when other processes take the core from it
    assert 20 < sampler.report.cpu_util_percent < 130


def test_a_sampler_measures_one_block():
    sampler = PeakMemorySampler(rss_reader=fake_reader([1]))
    with pytest.raises(RuntimeError, match="after the `with` block"):
        _ = sampler.report
    with sampler:
        pass
    with pytest.raises(RuntimeError, match="one block"):
        with sampler:
            pass


def test_bad_interval_is_a_clear_error():
    with pytest.raises(ValueError, match="interval=0"):
        PeakMemorySampler(interval=0)


class FakeGpu:
    """Stands in for NvmlGpu: a sequence of samples, then the last one again."""

    def __init__(self, samples: list[GpuSample]) -> None:
        self.samples, self.calls, self.closed = samples, 0, False

    def sample(self) -> GpuSample:
        self.calls += 1
        return self.samples[min(self.calls - 1, len(self.samples) - 1)]

    def close(self) -> None:
        self.closed = True


def test_gpu_telemetry_is_aggregated_through_the_same_thread():
    gpu = FakeGpu(
        [
            GpuSample(process_used_mb=None, device_used_mb=1000, util_percent=0, power_w=100),
            GpuSample(process_used_mb=None, device_used_mb=5000, util_percent=100, power_w=300),
        ]
    )
    with PeakMemorySampler(interval=0.001, rss_reader=fake_reader([1]), gpu=gpu) as sampler:
        pass
    report = sampler.report
    assert gpu.closed
    assert report.nvml_used_mb == 5000 and report.nvml_scope == "device"
    assert report.gpu_util_percent == 50 and report.power_w == 200
    assert report.gpu_peak_allocated_mb is None  # the torch allocator was not asked: device is cpu


def test_process_memory_wins_over_device_memory():
    gpu = FakeGpu([GpuSample(process_used_mb=700, device_used_mb=9000, util_percent=None, power_w=None)])
    with PeakMemorySampler(rss_reader=fake_reader([1]), gpu=gpu) as sampler:
        pass
    assert sampler.report.nvml_used_mb == 700 and sampler.report.nvml_scope == "process"
    assert sampler.report.power_w is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-machine fallbacks")
def test_nvml_wrapper_is_harmless_without_a_gpu():
    with NvmlGpu() as gpu:
        assert not gpu.available
        assert gpu.sample() == EMPTY_SAMPLE
    assert gpu_inventory() == []
    with pytest.raises(ValueError, match="no GPU"):
        PeakMemorySampler(device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_peaks():
    with PeakMemorySampler(device="cuda") as sampler:
        x = torch.ones(256 * MiB // 4, device="cuda")
        del x
    report = sampler.report
    assert report.gpu_peak_allocated_mb >= 256
    assert report.gpu_peak_reserved_mb >= report.gpu_peak_allocated_mb
