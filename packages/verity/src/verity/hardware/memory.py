"""Peak memory of each piece of work a process runs: the device's on an accelerator, the host's always.

    meter = PeakMeter.for_this_process()
    with meter.measure("actor/update_actor"):
        ...                                   # the work
    meter.take()   # {"actor/update_actor": MemoryPeak(device=..., host=...)}, in bytes; cleared

Device memory is what the accelerator's caching allocator handed to tensors at most during the
work (``max_memory_allocated`` after a reset of the peak, on CUDA, ROCm and NPU). Host memory is
the process's resident-set high-water mark (``VmHWM``), reset before the work by writing ``5`` to
``/proc/self/clear_refs`` (Linux). Where the kernel does not allow that reset, the host figure is
the process's peak since it started, and :attr:`PeakMeter.host_resets` says so. Several pieces of
work named alike (the same method called twice) keep the larger peak until :meth:`PeakMeter.take`.

The host figure is what the process holds at most, not what the work allocated: the allocator
keeps freed memory in the process, so work that needs no more than the process already holds
shows the process's resident size (``docs/hardware.md``, "Memory, recorded every step").
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["MemoryPeak", "PeakMeter", "host_peak_bytes", "release_free_host_memory", "reset_host_peak"]

_HWM = re.compile(r"^VmHWM:\s+(\d+)\s+kB", re.M)


def reset_host_peak() -> bool:
    """Reset this process's resident-set high-water mark; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


_LIBC: Any = None


def release_free_host_memory() -> bool:
    """Hand the C allocator's free pages back to the kernel (glibc's ``malloc_trim(0)``); False elsewhere.

    glibc keeps memory that tensors freed in its heaps and per-thread arenas, and does not
    return it while anything above it is still in use: over a run's calls a worker's resident
    set then grows by what its passes allocated and freed. Called between a worker's calls,
    this returns those pages, so that each call's peak starts from what the process really holds.
    """
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim  # noqa: B018  (musl and macOS have no malloc_trim)
        except (OSError, AttributeError):
            _LIBC = False
    if not _LIBC:
        return False
    _LIBC.malloc_trim(0)
    return True


def host_peak_bytes() -> int:
    """This process's resident-set high-water mark (since its start or the last reset), in bytes."""
    with contextlib.suppress(OSError), open("/proc/self/status", encoding="ascii") as f:
        found = _HWM.search(f.read())
        if found:
            return int(found.group(1)) * 1024
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@dataclass(frozen=True)
class MemoryPeak:
    """The peaks of one piece of work, in bytes: ``device`` (None on a CPU-only process) and ``host``."""

    device: int | None
    host: int

    def max(self, other: MemoryPeak) -> MemoryPeak:
        """The larger of the two peaks, device and host each."""
        device = None if self.device is None and other.device is None else max(self.device or 0, other.device or 0)
        return MemoryPeak(device, max(self.host, other.host))


class PeakMeter:
    """Measures the memory peak of named pieces of work in this process (see the module docstring).

    Args:
        runtime: the accelerator's torch module (``torch.cuda``, ``torch.npu``) or None on a CPU.
        index: the device index this process computes on.
    """

    def __init__(self, runtime: Any | None = None, index: int = 0) -> None:
        self.runtime = runtime
        self.index = index
        self.host_resets = True
        self._peaks: dict[str, MemoryPeak] = {}

    @classmethod
    def for_this_process(cls) -> PeakMeter:
        """The meter of this process's device: the accelerator torch sees (its own, under Ray's
        isolation index 0, else ``LOCAL_RANK``), or the host alone when there is none or the run is
        on the CPU (``VERITY_WORKER_DEVICE=cpu``)."""
        if os.environ.get("VERITY_WORKER_DEVICE") == "cpu":
            return cls()
        from verity.hardware import get_backend

        try:
            backend = get_backend(None)
        except Exception:  # no usable accelerator runtime: the host is what there is to measure
            return cls()
        runtime = backend._runtime()
        if runtime is None:
            return cls()
        count = backend.device_count()
        index = 0 if count <= 1 else int(os.environ.get("LOCAL_RANK", "0") or 0)
        return cls(runtime, index)

    @contextlib.contextmanager
    def measure(self, name: str) -> Iterator[None]:
        """Record the peak of the work inside the ``with`` block under ``name``."""
        if self.runtime is not None:
            self.runtime.reset_peak_memory_stats(self.index)
        self.host_resets = reset_host_peak() and self.host_resets
        try:
            yield
        finally:
            device = int(self.runtime.max_memory_allocated(self.index)) if self.runtime is not None else None
            peak = MemoryPeak(device, host_peak_bytes())
            earlier = self._peaks.get(name)
            self._peaks[name] = peak if earlier is None else earlier.max(peak)

    def take(self) -> dict[str, MemoryPeak]:
        """The peaks recorded since the last call, by name; clears them."""
        peaks, self._peaks = self._peaks, {}
        return peaks
