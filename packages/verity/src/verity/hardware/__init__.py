"""verity.hardware: one backend per device family (CUDA, ROCm, Ascend NPU, CPU).

    from verity.hardware import get_backend
    hw = get_backend()              # auto-detect, or VERITY_DEVICE=cuda|rocm|npu|cpu
    device = hw.device(local_rank)  # torch.device
    dist.init_process_group(hw.dist_backend)
    peak = hw.peak_flops()          # dense bf16 FLOP/s, None if unknown

See docs/hardware.md for what has and has not run on real hardware.
"""

from __future__ import annotations

from verity.hardware.backend import DEFAULT_PROBES, HardwareBackend, Probes, make_backend
from verity.hardware.cpu_peak import cpu_has_native_bf16, cpu_matmul_isa, measure_matmul_flops
from verity.hardware.detect import (
    BACKEND_NAMES,
    DEVICE_ENV,
    BackendUnavailableError,
    UnknownBackendError,
    available_backends,
    detect_backend,
    get_backend,
)
from verity.hardware.flops import KNOWN_DEVICES, lookup_device, mfu, peak_flops_for, training_flops_per_token

__all__ = [
    "BACKEND_NAMES",
    "DEFAULT_PROBES",
    "DEVICE_ENV",
    "KNOWN_DEVICES",
    "BackendUnavailableError",
    "HardwareBackend",
    "Probes",
    "UnknownBackendError",
    "available_backends",
    "cpu_has_native_bf16",
    "cpu_matmul_isa",
    "detect_backend",
    "get_backend",
    "lookup_device",
    "make_backend",
    "measure_matmul_flops",
    "mfu",
    "peak_flops_for",
    "training_flops_per_token",
]
