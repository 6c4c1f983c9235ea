"""verity.engines: training backends behind one interface.

- :class:`FSDP2Engine` (default): ``fully_shard`` per decoder layer, CPU/gloo and GPU/nccl.
- ``megatron``: a GPU-only placeholder that raises :class:`EngineUnavailableError`.

Build one by name with :func:`build_engine`.
"""

from __future__ import annotations

from typing import Any

from verity.engines.base import (
    EngineUnavailableError,
    LossFn,
    TrainingEngine,
    make_aggregation_context,
)
from verity.engines.fsdp2 import FSDP2Engine
from verity.engines.logprobs import logprobs_and_entropy_from_logits, response_logprobs
from verity.engines.optim import (
    OptimConfig,
    build_lr_scheduler,
    build_optimizer,
    clip_gradients,
    lr_multiplier,
)

ENGINES = ("fsdp2", "megatron")


def build_engine(name: str, *args: Any, **kwargs: Any) -> TrainingEngine:
    """Construct the engine called ``name`` (one of :data:`ENGINES`) with the given arguments."""
    if name == "fsdp2":
        return FSDP2Engine(*args, **kwargs)
    if name == "megatron":
        from verity.engines.megatron import raise_unavailable

        raise_unavailable()
    raise ValueError(f"unknown engine {name!r}; known engines: {', '.join(ENGINES)}")


__all__ = [
    "ENGINES",
    "EngineUnavailableError",
    "FSDP2Engine",
    "LossFn",
    "OptimConfig",
    "TrainingEngine",
    "build_engine",
    "build_lr_scheduler",
    "build_optimizer",
    "clip_gradients",
    "logprobs_and_entropy_from_logits",
    "lr_multiplier",
    "make_aggregation_context",
    "response_logprobs",
]
