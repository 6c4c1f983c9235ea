"""What the trained roles (actor, critic) share: their optimizer settings, engine and epoch loop.

A role is the ``actor`` or ``critic`` section of the run config: each has its own
``optim`` (:class:`~verity.config.schema.OptimConfig`), ``ppo_mini_batch_size``
(prompts per optimizer step) and ``ppo_epochs``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from verity.batch import Batch
from verity.config.schema import OptimConfig, VerityConfig
from verity.engines import FSDP2Engine
from verity.engines import OptimConfig as EngineOptimConfig


class TrainedRole(Protocol):
    """The config fields of a role trained by mini-batch epochs (``cfg.actor``, ``cfg.critic``)."""

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


def engine_optim_config(optim: OptimConfig, total_optimizer_steps: int) -> EngineOptimConfig:
    """Map a role's ``optim`` section onto the engine's optimizer settings.

    ``total_optimizer_steps`` (optimizer steps of the whole run, floored at 1) is the
    horizon of the LR schedule.
    """
    return EngineOptimConfig(
        lr=optim.lr,
        betas=(float(optim.betas[0]), float(optim.betas[1])),
        weight_decay=optim.weight_decay,
        max_grad_norm=optim.grad_clip,
        warmup_steps=optim.warmup_steps,
        lr_schedule=optim.scheduler,
        total_steps=max(1, total_optimizer_steps),
        min_lr_ratio=optim.min_lr_ratio,
    )


def optimizer_steps_per_rl_step(cfg: VerityConfig, role: TrainedRole) -> int:
    """Optimizer steps ``role`` takes per RL step: mini-batches (prompts) x epochs."""
    return (cfg.data.train_batch_size // role.ppo_mini_batch_size) * role.ppo_epochs


def build_role_engine(
    model: torch.nn.Module, cfg: VerityConfig, role: TrainedRole, device: torch.device
) -> FSDP2Engine:
    """An FSDP2 engine that trains ``model`` on ``device`` with ``role.optim``.

    The LR schedule spans ``optimizer_steps_per_rl_step x trainer.total_steps``
    optimizer steps; ``model.gradient_checkpointing`` applies.
    """
    total = optimizer_steps_per_rl_step(cfg, role) * max(1, cfg.trainer.total_steps)
    return FSDP2Engine(
        model,
        engine_optim_config(role.optim, total),
        device=device,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
    )


def minibatch_epochs(
    batch: Batch, rows_per_mini: int, epochs: int, step: Callable[[Batch], dict[str, Any]]
) -> tuple[dict[str, float], int]:
    """``epochs`` passes over ``batch`` in consecutive mini-batches of ``rows_per_mini`` rows (the last
    may be shorter), calling ``step(mini)`` (one optimizer step) on each.

    Returns the per-key sums, as floats, of the metrics the steps returned, and
    the number of steps taken.
    """
    sums: dict[str, float] = {}
    steps = 0
    for _ in range(epochs):
        for start in range(0, len(batch), rows_per_mini):
            metrics = step(batch.index(slice(start, start + rows_per_mini)))
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value)
            steps += 1
    return sums, steps
