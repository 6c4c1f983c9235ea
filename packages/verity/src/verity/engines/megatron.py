"""Megatron-core engine: a placeholder for the GPU-only tensor/pipeline-parallel backend.

Not implemented in this version. It exists so that ``engine: megatron`` in a config
fails at start-up with a clear message instead of deep inside a run. Use
``engine: fsdp2`` (:class:`verity.engines.fsdp2.FSDP2Engine`), which runs on CPU and GPU.
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch

from verity.engines.base import EngineUnavailableError


class MegatronEngine:
    """Always raises :class:`EngineUnavailableError` (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise_unavailable()


def raise_unavailable() -> NoReturn:
    """Raise the error that explains why the Megatron-core engine cannot be used."""
    if not torch.cuda.is_available():
        raise EngineUnavailableError(
            "the megatron engine needs CUDA GPUs and megatron-core; this machine has no GPU. "
            "Use engine 'fsdp2', which trains on CPU (gloo) and GPU (nccl)."
        )
    raise EngineUnavailableError(
        "the megatron engine is not implemented in this version of verity; use engine 'fsdp2'."
    )
