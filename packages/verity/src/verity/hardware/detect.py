"""Choosing the hardware backend: auto-detection with an explicit override.

Order of precedence:

1. the ``name`` argument of :func:`get_backend`,
2. the ``VERITY_DEVICE`` environment variable,
3. auto-detection, first available of: npu > rocm > cuda > cpu.

"auto" in 1 or 2 means "detect". Aliases: "hip" → rocm, "ascend" → npu,
"gpu" → whichever of rocm/cuda is present.
"""

from __future__ import annotations

import os

from verity.hardware.backend import DEFAULT_PROBES, HardwareBackend, Probes, make_backend

DEVICE_ENV = "VERITY_DEVICE"
BACKEND_NAMES: tuple[str, ...] = ("npu", "rocm", "cuda", "cpu")  # detection order
_ALIASES = {"hip": "rocm", "ascend": "npu"}


class UnknownBackendError(ValueError):
    """A backend name that verity does not know."""


class BackendUnavailableError(RuntimeError):
    """A known backend that this machine cannot run."""


def available_backends(probes: Probes = DEFAULT_PROBES) -> list[str]:
    """Names of the backends usable here, in detection order (always ends with "cpu")."""
    return [name for name in BACKEND_NAMES if make_backend(name, probes).is_available()]


def detect_backend(probes: Probes = DEFAULT_PROBES) -> HardwareBackend:
    """The first available backend in the order npu > rocm > cuda > cpu."""
    for name in BACKEND_NAMES:
        backend = make_backend(name, probes)
        if backend.is_available():
            return backend
    raise AssertionError("unreachable: the cpu backend is always available")


def get_backend(name: str | None = None, *, probes: Probes = DEFAULT_PROBES) -> HardwareBackend:
    """The hardware backend to run on.

    Args:
        name: "cuda" | "rocm" | "npu" | "cpu" | "gpu" | "auto" (or an alias),
            or None to read ``VERITY_DEVICE`` and otherwise auto-detect.
        probes: how the machine is queried; tests pass fakes.

    Raises:
        UnknownBackendError: the name is not a backend; the message lists the choices.
        BackendUnavailableError: the backend is known but absent here; the
            message lists what is available.
    """
    source = "argument"
    if name is None:
        name = os.environ.get(DEVICE_ENV) or None
        source = f"environment variable {DEVICE_ENV}"
    if name is None:
        return detect_backend(probes)
    if not isinstance(name, str):
        raise TypeError(f"backend name must be a str or None, got {type(name).__name__}")
    wanted = _ALIASES.get(name.strip().lower(), name.strip().lower())
    if wanted == "auto":
        return detect_backend(probes)
    available = available_backends(probes)
    if wanted == "gpu":
        for candidate in ("rocm", "cuda"):
            if candidate in available:
                return make_backend(candidate, probes)
        raise BackendUnavailableError(
            f"hardware backend 'gpu' (from {source}) needs CUDA or ROCm, and neither is available; "
            f"available here: {', '.join(available)}"
        )
    if wanted not in BACKEND_NAMES:
        choices = ", ".join((*BACKEND_NAMES, "gpu", "auto"))
        raise UnknownBackendError(
            f"unknown hardware backend {name!r} (from {source}); choose one of: {choices}"
        )
    if wanted not in available:
        raise BackendUnavailableError(
            f"hardware backend {wanted!r} (from {source}) is not available on this machine; "
            f"available here: {', '.join(available)}"
        )
    return make_backend(wanted, probes)
