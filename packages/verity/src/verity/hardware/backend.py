"""One hardware backend per device family: what a worker needs to know about its device.

A :class:`HardwareBackend` answers, for CUDA, ROCm, Ascend NPU or CPU:

* which torch device string to use (``device_type``: "cuda" for both NVIDIA and
  AMD, since torch's HIP build answers behind ``torch.cuda``; "npu"; "cpu"),
* which ``torch.distributed`` backend forms process groups (``dist_backend``:
  nccl; nccl again on ROCm, where torch routes it to RCCL; hccl; gloo),
* which Ray resource a worker asks for (``ray_resource``: GPU, NPU, CPU),
* which environment variable restricts the visible devices
  (``visible_devices_env``), and
* device queries: count, name, memory statistics, peak FLOP/s for MFU.

Every question to the machine goes through a :class:`Probes` object — a bundle
of small functions — so tests can fake a ROCm or Ascend machine on a CPU-only
host by passing other functions.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import platform
import resource
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from verity.hardware.flops import peak_flops_for


def _torch_cuda_available() -> bool:
    return bool(torch.cuda.is_available())


def _torch_hip_version() -> str | None:
    return getattr(torch.version, "hip", None)


def _torch_npu_runtime() -> Any:
    """Import torch_npu (which registers ``torch.npu``) and return ``torch.npu``."""
    importlib.import_module("torch_npu")
    return torch.npu  # type: ignore[attr-defined]


def _torch_npu_available() -> bool:
    try:
        runtime = _torch_npu_runtime()
    except Exception:  # torch_npu missing or its driver libraries absent
        return False
    return bool(runtime.is_available())


@dataclass(frozen=True)
class Probes:
    """How verity asks the machine what it has. Tests swap these for fakes.

    ``cuda_runtime`` / ``npu_runtime`` return a module with torch.cuda's device
    API (``device_count``, ``get_device_name``, ``memory_allocated``, ...).
    """

    cuda_available: Callable[[], bool] = _torch_cuda_available
    hip_version: Callable[[], str | None] = _torch_hip_version
    npu_available: Callable[[], bool] = _torch_npu_available
    cuda_runtime: Callable[[], Any] = lambda: torch.cuda
    npu_runtime: Callable[[], Any] = _torch_npu_runtime


DEFAULT_PROBES = Probes()


@dataclass(frozen=True)
class HardwareBackend:
    """A device family and how verity talks to it.

    Fields:
        name: "cuda" | "rocm" | "npu" | "cpu".
        device_type: torch device type string ("cuda", "npu", "cpu").
        dist_backend: torch.distributed backend ("nccl", "hccl", "gloo").
        collective_library: the library doing the collectives, for display
            ("NCCL", "RCCL", "HCCL", "Gloo").
        ray_resource: Ray resource name a worker reserves ("GPU", "NPU", "CPU").
        visible_devices_env: the variable Ray and the runtime use to restrict
            visible devices (None on CPU).
        other_visible_devices_envs: further variables the runtime also honours
            (ROCm: ROCR_VISIBLE_DEVICES).
        probes: how the machine is queried (fakeable).
    """

    name: str
    device_type: str
    dist_backend: str
    collective_library: str
    ray_resource: str
    visible_devices_env: str | None
    other_visible_devices_envs: tuple[str, ...] = ()
    probes: Probes = field(default=DEFAULT_PROBES, repr=False, compare=False)

    # ---- availability -------------------------------------------------
    def is_available(self) -> bool:
        """Whether this device family is usable in this process."""
        if self.name == "cpu":
            return True
        if self.name == "npu":
            return bool(self.probes.npu_available())
        if not self.probes.cuda_available():
            return False
        is_hip_build = self.probes.hip_version() is not None
        return is_hip_build if self.name == "rocm" else not is_hip_build

    def _runtime(self) -> Any:
        """The torch device module (torch.cuda / torch.npu); None on CPU."""
        if self.name == "cpu":
            return None
        if not self.is_available():
            raise RuntimeError(f"hardware backend {self.name!r} is not available on this machine")
        return self.probes.npu_runtime() if self.name == "npu" else self.probes.cuda_runtime()

    # ---- devices ----------------------------------------------------------
    def device(self, local_rank: int = 0) -> torch.device:
        """The torch device of the worker with this node-local rank (CPU ignores the rank)."""
        if not isinstance(local_rank, int) or local_rank < 0:
            raise ValueError(f"local_rank must be an int >= 0, got {local_rank!r}")
        if self.name == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, local_rank)

    def device_count(self) -> int:
        """Visible devices of this family (CPU: 1, the host as one device)."""
        runtime = self._runtime()
        return 1 if runtime is None else int(runtime.device_count())

    def device_name(self, index: int = 0) -> str:
        """The runtime's name for device ``index`` (CPU: the processor model)."""
        runtime = self._runtime()
        if runtime is None:
            return _cpu_model_name()
        return str(runtime.get_device_name(index))

    def peak_flops(self, dtype: torch.dtype = torch.bfloat16, index: int = 0) -> float | None:
        """Dense peak FLOP/s of device ``index`` for ``dtype`` from the known-device table.

        None for CPUs, unknown devices and dtypes without a table entry.
        """
        if self.name == "cpu":
            return None
        return peak_flops_for(self.device_name(index), dtype)

    def memory_stats(self, index: int = 0) -> dict[str, int]:
        """Memory of device ``index`` in bytes.

        Keys: ``allocated`` (live tensors), ``reserved`` (held by the caching
        allocator), ``peak`` (max allocated since start or last reset),
        ``total`` (device capacity). On CPU: the process's resident set size for
        allocated and reserved, its peak resident size, and physical RAM.
        """
        runtime = self._runtime()
        if runtime is None:
            rss = _process_rss_bytes()
            return {
                "allocated": rss,
                "reserved": rss,
                # the kernel updates the high-water mark lazily; never report it below now
                "peak": max(rss, _process_peak_rss_bytes()),
                "total": _physical_memory_bytes(),
            }
        return {
            "allocated": int(runtime.memory_allocated(index)),
            "reserved": int(runtime.memory_reserved(index)),
            "peak": int(runtime.max_memory_allocated(index)),
            "total": int(runtime.get_device_properties(index).total_memory),
        }

    def empty_cache(self) -> None:
        """Return cached, unused device memory to the driver (no-op on CPU)."""
        runtime = self._runtime()
        if runtime is not None:
            runtime.empty_cache()

    def synchronize(self) -> None:
        """Wait for all queued device work (no-op on CPU)."""
        runtime = self._runtime()
        if runtime is not None:
            runtime.synchronize()

    def manual_seed(self, seed: int) -> None:
        """Seed torch's CPU generator and every device generator of this family."""
        if not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        torch.manual_seed(seed)
        runtime = self._runtime()
        if runtime is not None:
            runtime.manual_seed_all(seed)

    def visible_devices(self) -> list[str] | None:
        """Device ids listed in the visible-devices variable, or None if it is unset."""
        for env in (self.visible_devices_env, *self.other_visible_devices_envs):
            if env and env in os.environ:
                value = os.environ[env].strip()
                return [part.strip() for part in value.split(",") if part.strip()]
        return None


def make_backend(name: str, probes: Probes = DEFAULT_PROBES) -> HardwareBackend:
    """The backend description for one family name ("cuda", "rocm", "npu", "cpu")."""
    if name == "cuda":
        return HardwareBackend("cuda", "cuda", "nccl", "NCCL", "GPU", "CUDA_VISIBLE_DEVICES", (), probes)
    if name == "rocm":
        # torch's HIP build exposes the device as "cuda" and maps the nccl
        # backend onto RCCL; Ray sets HIP_VISIBLE_DEVICES for AMD GPUs.
        return HardwareBackend(
            "rocm", "cuda", "nccl", "RCCL", "GPU", "HIP_VISIBLE_DEVICES", ("ROCR_VISIBLE_DEVICES",), probes
        )
    if name == "npu":
        return HardwareBackend("npu", "npu", "hccl", "HCCL", "NPU", "ASCEND_RT_VISIBLE_DEVICES", (), probes)
    if name == "cpu":
        return HardwareBackend("cpu", "cpu", "gloo", "Gloo", "CPU", None, (), probes)
    raise ValueError(f"unknown hardware backend {name!r}; expected one of cuda, rocm, npu, cpu")


# ---- CPU host queries --------------------------------------------------------


def _cpu_model_name() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
        for line in cpuinfo:
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "cpu"


def _process_rss_bytes() -> int:
    with (
        contextlib.suppress(OSError, ValueError, IndexError),
        open("/proc/self/statm", encoding="utf-8") as f,
    ):
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return _process_peak_rss_bytes()


def _process_peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kilobytes, macOS bytes.
    return int(peak) if platform.system() == "Darwin" else int(peak) * 1024


def _physical_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0
