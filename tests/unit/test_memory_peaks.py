"""Peak memory per piece of work (verity.hardware.memory): reset before, read after, kept per name."""

from __future__ import annotations

import pytest
from verity.hardware.memory import MemoryPeak, PeakMeter, host_peak_bytes


def _touch(megabytes: int) -> int:
    block = bytearray(megabytes * 1024 * 1024)
    block[::4096] = b"x" * len(block[::4096])
    return len(block)


def test_the_host_peak_is_reset_before_each_piece_of_work() -> None:
    meter = PeakMeter()
    with meter.measure("big"):
        _touch(200)
    with meter.measure("small"):
        _touch(1)
    peaks = meter.take()
    assert peaks["big"].device is None
    if meter.host_resets:  # Linux lets a process reset its high-water mark
        assert peaks["big"].host - peaks["small"].host > 150 * 1024**2, peaks
    else:
        assert peaks["small"].host >= peaks["big"].host  # a lifetime peak never falls
    assert meter.take() == {}


def test_the_same_name_keeps_the_larger_peak_until_taken() -> None:
    meter = PeakMeter()
    with meter.measure("generate"):
        _touch(150)
    with meter.measure("generate"):
        _touch(1)
    assert meter.take()["generate"].host >= 150 * 1024**2


class _FakeDevice:
    """A runtime whose allocator peaks at what the work asked for since the last reset."""

    def __init__(self) -> None:
        self.peak = 0
        self.resets = 0

    def reset_peak_memory_stats(self, index: int) -> None:
        self.resets += 1
        self.peak = 0

    def max_memory_allocated(self, index: int) -> int:
        return self.peak


def test_on_an_accelerator_the_device_peak_is_read_after_a_reset() -> None:
    device = _FakeDevice()
    meter = PeakMeter(device, index=0)
    with meter.measure("update_actor"):
        device.peak = 5 * 1024**3
    with meter.measure("generate"):
        device.peak = 2 * 1024**3
    peaks = meter.take()
    assert (peaks["update_actor"].device, peaks["generate"].device, device.resets) == (5 * 1024**3, 2 * 1024**3, 2)
    assert peaks["generate"].host > 0


def test_peaks_combine_device_and_host_each() -> None:
    assert MemoryPeak(3, 10).max(MemoryPeak(5, 7)) == MemoryPeak(5, 10)
    assert MemoryPeak(None, 4).max(MemoryPeak(None, 9)) == MemoryPeak(None, 9)
    assert host_peak_bytes() > 0


class _Group:
    def __init__(self, peaks: dict) -> None:
        self.peaks = peaks

    def memory_peaks(self) -> dict:
        return self.peaks


def test_the_step_metrics_name_each_role_and_method_in_gib() -> None:
    from verity.trainer.loop import memory_metrics

    gib = 1024**3
    cpu = _Group({"actor/generate": (None, 2 * gib), "actor/update_actor": (None, 3 * gib)})
    gpu = _Group({"critic/update_critic": (5 * gib, gib // 2)})
    metrics = memory_metrics([cpu, gpu])
    assert metrics == {
        "memory/actor/generate_gb": 2.0,
        "memory/actor/update_actor_gb": 3.0,
        "memory/critic/update_critic_gb": 5.0,  # an accelerator's: device memory
        "memory/critic/update_critic_host_gb": 0.5,  # and the host's beside it
        "perf/max_memory_gb": 5.0,
    }
    assert memory_metrics([_Group({})]) == {}


def _resident_bytes() -> int:
    import re

    with open("/proc/self/status", encoding="ascii") as f:
        return int(re.search(r"^VmRSS:\s+(\d+)\s+kB", f.read(), re.M).group(1)) * 1024


def test_memory_freed_in_the_heap_goes_back_to_the_kernel():
    import ctypes

    import torch
    from verity.hardware.memory import release_free_host_memory

    if not release_free_host_memory():
        pytest.skip("no glibc malloc_trim here")
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's mallopt parameters
    # as in a long-running worker: 1 MiB blocks come from the heap, and free() keeps what it frees
    libc.mallopt(m_mmap_threshold, 4 * 2**20)
    libc.mallopt(m_trim_threshold, 2**30)
    try:
        start = _resident_bytes()
        blocks = [torch.ones(256 * 1024) for _ in range(256)]  # 256 x 1 MiB
        keep = torch.ones(16)  # allocated after them: the heap cannot shrink from its top
        del blocks
        held = _resident_bytes()
        release_free_host_memory()
        after = _resident_bytes()
    finally:  # glibc's defaults back
        libc.mallopt(m_mmap_threshold, 128 * 1024)
        libc.mallopt(m_trim_threshold, 128 * 1024)
    assert held > start + 192 * 2**20  # freeing alone gave nothing back
    assert after < start + 64 * 2**20  # the call did
    assert keep.sum() == 16
