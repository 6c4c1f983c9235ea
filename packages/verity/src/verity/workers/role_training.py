"""What the trained roles (actor, critic, a plug-in's) share: their engine, optimizer and epoch loop.

A trained role's config section (``actor``, ``critic``, ...) names its ``engine``
(built through :mod:`verity.engines.registry`) and has its own ``optim``
(:class:`~verity.engines.optim.OptimConfig`), ``ppo_mini_batch_size`` (prompts per
optimizer step) and ``ppo_epochs``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from verity.batch import Batch
from verity.config.schema import VerityConfig
from verity.engines import EngineBuildContext, OptimConfig, TrainingEngine, build_training_engine


class TrainedRole(Protocol):
    """The config fields of a role trained by mini-batch epochs (``cfg.actor``, ``cfg.critic``)."""

    engine: str
    optim: OptimConfig
    ppo_mini_batch_size: int
    ppo_epochs: int


def role_device(backend: Any, local_rank: int) -> torch.device:
    """The device a role's worker computes on.

    Ray gives each GPU worker only its own device, visible as index 0; without that
    isolation (several devices visible to one process) the worker's local rank picks
    its device. ``backend`` is a :mod:`verity.hardware` backend.
    """
    return backend.device(0 if backend.device_count() <= 1 else local_rank)


def optimizer_steps_per_rl_step(cfg: VerityConfig, role: TrainedRole) -> int:
    """Optimizer steps ``role`` takes per RL step: mini-batches (prompts) x epochs."""
    return (cfg.data.train_batch_size // role.ppo_mini_batch_size) * role.ppo_epochs


def role_model_dtype(cfg: VerityConfig) -> torch.dtype:
    """The dtype roles load their weights in (``model.dtype``)."""
    return torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32


def rollout_dtype(cfg: VerityConfig) -> torch.dtype:
    """The dtype the rollout serves the policy in: ``rollout.dtype``, or ``model.dtype`` when null."""
    name = cfg.rollout.dtype or cfg.model.dtype
    return torch.bfloat16 if name == "bfloat16" else torch.float32


def build_role_engine(
    role_name: str,
    load_model: Callable[[], torch.nn.Module],
    cfg: VerityConfig,
    role: TrainedRole,
    device: torch.device,
    model_path: str,
) -> TrainingEngine:
    """The engine named ``role.engine`` training the module ``load_model()`` on ``device`` with ``role.optim``.

    The LR schedule spans ``optimizer_steps_per_rl_step x trainer.total_steps``
    optimizer steps; ``model.gradient_checkpointing`` applies; the engine's own
    settings are the role section's field named after it (``actor.fsdp2``), if any;
    LoRA adapters are the section's ``lora`` (``actor.lora``), if it has one.
    """
    total = optimizer_steps_per_rl_step(cfg, role) * max(1, cfg.trainer.total_steps)
    ctx = EngineBuildContext(
        role=role_name,
        load_model=load_model,
        model_path=model_path,
        device=device,
        optim=role.optim,
        total_steps=total,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        options=getattr(role, role.engine, None),
        lora=getattr(role, "lora", None),
        seed=cfg.trainer.seed,
        cfg=cfg,
    )
    return build_training_engine(role.engine, ctx)


def minibatch_epochs(
    batch: Batch, rows_per_mini: int, epochs: int, step: Callable[[Batch], dict[str, Any]]
) -> tuple[dict[str, float], int]:
    """``epochs`` passes over ``batch`` in consecutive mini-batches of ``rows_per_mini`` rows (the last
    may be shorter), calling ``step(mini)`` (one optimizer step) on each.

    The trailing ``batch.pad_rows`` rows (padding that ``Batch.split`` added so that the
    rows divide over the ranks) stay marked as padding in the mini-batches that hold
    them, so the engine leaves them out of the loss and its counts.

    Returns the per-key sums, as floats, of the metrics the steps returned, and
    the number of steps taken.
    """
    sums: dict[str, float] = {}
    steps = 0
    size = len(batch)
    real = size - int(getattr(batch, "pad_rows", 0) or 0)
    for _ in range(epochs):
        for start in range(0, size, rows_per_mini):
            stop = min(start + rows_per_mini, size)
            mini = batch.index(slice(start, stop))
            mini.pad_rows = max(0, stop - max(start, real))
            metrics = step(mini)
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value)
            steps += 1
    return sums, steps
