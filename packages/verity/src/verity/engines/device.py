"""Which device a training engine computes on: the default, and ``cuda`` made concrete."""

from __future__ import annotations

import os

import torch

__all__ = ["default_device", "resolve_device"]


def default_device() -> torch.device:
    """``cuda:$LOCAL_RANK`` when CUDA is available, else ``cpu``."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``device`` as a ``torch.device`` with an index where CUDA needs one; None: :func:`default_device`.

    A bare ``"cuda"`` means torch's current CUDA device (``torch.cuda.set_device`` and
    ``init_device_mesh`` refuse a CUDA device without an index).
    """
    if device is None:
        return default_device()
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved
