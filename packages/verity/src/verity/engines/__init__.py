"""verity.engines: training backends behind one interface, built by name.

- :class:`FSDP2Engine` (``fsdp2``, the default): ``fully_shard`` per decoder layer,
  CPU/gloo and GPU/nccl.
- ``MegatronEngine`` (``megatron``, :mod:`verity.engines.megatron`): Megatron-core tensor, pipeline
  and data parallelism (CPU/gloo and GPU/nccl); needs the ``megatron`` extra.

An engine is chosen by ``actor.engine`` / ``critic.engine`` and built through
:func:`build_training_engine` from the registry in :mod:`verity.engines.registry`;
plug-ins add engines with :func:`register_training_engine`.
"""

from __future__ import annotations

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
    clip_coefficient,
    clip_gradients,
    lr_multiplier,
    scale_gradients,
)
from verity.engines.options import FSDP2Options
from verity.engines.registry import (
    TRAINING_ENGINES,
    EngineBuildContext,
    EngineSpec,
    build_training_engine,
    register_training_engine,
)

__all__ = [
    "TRAINING_ENGINES",
    "EngineBuildContext",
    "EngineSpec",
    "EngineUnavailableError",
    "FSDP2Engine",
    "FSDP2Options",
    "LossFn",
    "OptimConfig",
    "TrainingEngine",
    "build_lr_scheduler",
    "build_optimizer",
    "build_training_engine",
    "clip_coefficient",
    "clip_gradients",
    "logprobs_and_entropy_from_logits",
    "lr_multiplier",
    "make_aggregation_context",
    "register_training_engine",
    "response_logprobs",
    "scale_gradients",
]
