"""Optimizer, learning-rate schedule and gradient clipping for training engines.

The optimizer is AdamW (decoupled weight decay, Loshchilov & Hutter 2019). It runs
on whatever parameters the engine owns: plain tensors in a single process, or the
FSDP2 ``DTensor`` shards in a data-parallel group, where each rank updates only its
own shard.

Learning-rate schedule, as a multiplier ``f(s)`` of the peak ``lr`` at optimizer
step ``s`` (0-based), with ``W`` warm-up steps and ``T`` total steps::

    warm-up   (s < W):  f(s) = (s + 1) / W                 linear, never exactly 0
    constant  (s >= W): f(s) = 1
    cosine    (s >= W): f(s) = m + (1 - m) * 0.5 * (1 + cos(pi * p)),
                        p = min(1, (s - W) / max(1, T - W)),  m = min_lr_ratio

The warm-up starts at ``lr / W`` rather than 0 so that the first step is not wasted.

Gradient clipping rescales all gradients by ``min(1, max_norm / (||g||_2 + 1e-6))``
where ``||g||_2`` is the global L2 norm over every parameter of the model (over all
shards, for FSDP2: ``torch.nn.utils.clip_grad_norm_`` reduces ``DTensor`` gradients
across the group).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

LR_SCHEDULES = ("constant", "cosine")


@dataclass
class OptimConfig:
    """Optimizer settings owned by a training engine.

    Attributes:
        lr: peak learning rate (after warm-up); 0 leaves the weights unchanged.
        betas: AdamW ``(beta1, beta2)``.
        eps: AdamW epsilon.
        weight_decay: decoupled weight decay coefficient.
        max_grad_norm: clip the global gradient L2 norm to this value; ``<= 0`` or
            ``inf`` disables clipping (the norm is still measured and reported).
        warmup_steps: number of linear warm-up optimizer steps (0 = none).
        warmup_ratio: if > 0 and ``total_steps`` is set, warm-up length is
            ``round(warmup_ratio * total_steps)``; it overrides ``warmup_steps``.
        lr_schedule: ``"constant"`` or ``"cosine"`` after warm-up.
        total_steps: total optimizer steps, required by ``"cosine"`` and ``warmup_ratio``.
        min_lr_ratio: the cosine schedule's floor as a fraction of ``lr``.
    """

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    lr_schedule: str = "constant"
    total_steps: int | None = None
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)  # type: ignore[assignment]
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first setting that is out of range."""
        if not self.lr >= 0:  # 0 is allowed: a frozen run (e.g. a planted regression in the nightly)
            raise ValueError(f"optim.lr must be >= 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"optim.betas must be two numbers in [0, 1), got {self.betas}")
        if not self.eps > 0:
            raise ValueError(f"optim.eps must be > 0, got {self.eps}")
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"optim.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"optim.lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        if self.total_steps is not None and self.total_steps <= 0:
            raise ValueError(f"optim.total_steps must be > 0 or None, got {self.total_steps}")
        if self.lr_schedule == "cosine" and self.total_steps is None:
            raise ValueError("optim.lr_schedule='cosine' needs optim.total_steps")
        if self.warmup_ratio > 0 and self.total_steps is None:
            raise ValueError("optim.warmup_ratio > 0 needs optim.total_steps")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")

    @property
    def effective_warmup_steps(self) -> int:
        """Warm-up length in optimizer steps after resolving ``warmup_ratio``."""
        if self.warmup_ratio > 0 and self.total_steps is not None:
            return int(round(self.warmup_ratio * self.total_steps))
        return self.warmup_steps


def lr_multiplier(step: int, config: OptimConfig) -> float:
    """The schedule factor ``f(step)`` (see the module docstring); ``lr = config.lr * f``."""
    warmup = config.effective_warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if config.lr_schedule == "constant":
        return 1.0
    total = config.total_steps or 1
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    m = config.min_lr_ratio
    return m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(params: Iterable[nn.Parameter], config: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the trainable ``params`` (those with ``requires_grad``)."""
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError("build_optimizer: the model has no parameter with requires_grad=True")
    return torch.optim.AdamW(
        trainable,
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
    )


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, config: OptimConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` applying :func:`lr_multiplier`; call ``.step()`` once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, config))


def clip_gradients(parameters: Iterable[nn.Parameter], max_norm: float) -> float:
    """Clip gradients in place to global L2 norm ``max_norm``; return the norm before clipping.

    Works for plain tensors and for FSDP2 ``DTensor`` shards (the norm is reduced over
    the whole data-parallel group, so every rank returns the same value). ``max_norm
    <= 0`` or ``inf`` only measures. A non-finite norm is returned as is (gradients are
    left unscaled); the caller decides whether to skip the step.
    """
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return 0.0
    limit = max_norm if max_norm > 0 else float("inf")
    total = torch.nn.utils.clip_grad_norm_(params, limit, error_if_nonfinite=False, foreach=None)
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()
    return float(total)
