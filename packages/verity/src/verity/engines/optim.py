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
from dataclasses import dataclass, field

import torch
from torch import nn

LR_SCHEDULES = ("constant", "cosine")


@dataclass
class OptimConfig:
    """Optimizer settings of one trained role (``actor.optim``, ``critic.optim``, ...).

    The same dataclass is the config section and what the engines read; the LR
    schedule's horizon (``total_steps``, optimizer steps of the whole run) is not a
    setting but derived by the caller and passed beside it.
    """

    lr: float = 1e-6  # peak learning rate (after warm-up); 0 leaves the weights unchanged
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW (beta1, beta2)
    eps: float = 1e-8  # AdamW epsilon
    warmup_steps: int = 0  # optimizer steps of linear warm-up
    warmup_ratio: float = 0.0  # > 0: warm-up = round(ratio x total optimizer steps), overrides warmup_steps
    scheduler: str = "constant"  # after warm-up: constant | cosine
    min_lr_ratio: float = 0.0  # cosine floor, as a fraction of lr
    grad_clip: float = 1.0  # max global grad L2 norm; <= 0 disables clipping (the norm is still reported)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first setting that is out of range."""
        if not self.lr >= 0:  # 0 is allowed: a frozen run (e.g. a planted regression in the nightly)
            raise ValueError(f"lr must be >= 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0.0 <= float(b) < 1.0 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {list(self.betas)}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.scheduler not in LR_SCHEDULES:
            raise ValueError(f"scheduler must be one of {'|'.join(LR_SCHEDULES)}, got {self.scheduler!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")

    def warmup_length(self, total_steps: int) -> int:
        """Warm-up length in optimizer steps, ``warmup_ratio`` resolved against ``total_steps``."""
        if self.warmup_ratio > 0:
            return int(round(self.warmup_ratio * total_steps))
        return self.warmup_steps


def lr_multiplier(step: int, config: OptimConfig, total_steps: int = 1) -> float:
    """The schedule factor ``f(step)`` (see the module docstring); ``lr = config.lr * f``.

    ``total_steps``: optimizer steps of the whole run (the cosine horizon ``T``).
    """
    warmup = config.warmup_length(total_steps)
    if step < warmup:
        return (step + 1) / warmup
    if config.scheduler == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    m = config.min_lr_ratio
    return m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(params: Iterable[nn.Parameter], config: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the trainable ``params`` (those with ``requires_grad``); fused on CPU and CUDA."""
    config.validate()
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError("build_optimizer: the model has no parameter with requires_grad=True")
    # the fused kernel (one pass over all parameters) where torch has it: faster than the
    # foreach and per-parameter steps (ci/reports/2026-12-06-docstring-figures.md)
    fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in trainable)
    return torch.optim.AdamW(
        trainable,
        lr=config.lr,
        betas=(float(config.betas[0]), float(config.betas[1])),
        eps=config.eps,
        weight_decay=config.weight_decay,
        fused=fused or None,
    )


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, config: OptimConfig, total_steps: int = 1
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` applying :func:`lr_multiplier`; call ``.step()`` once per optimizer step."""
    horizon = max(1, int(total_steps))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, config, horizon))


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor ``min(1, max_norm / (total_norm + 1e-6))`` that clipping multiplies gradients by.

    ``max_norm <= 0`` or ``inf`` disables clipping (factor 1). The same formula as
    ``torch.nn.utils.clip_grad_norm_``, for engines that compute the global norm themselves.
    """
    if not max_norm > 0 or math.isinf(max_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


@torch.no_grad()
def scale_gradients(parameters: Iterable[nn.Parameter], total_norm: float, max_norm: float) -> float:
    """Clip gradients in place given their global L2 norm ``total_norm``; returns the factor used.

    For engines whose parameters are split in ways ``clip_grad_norm_`` cannot see
    (tensor/pipeline parallelism): the caller measures the norm over all shards.
    """
    factor = clip_coefficient(total_norm, max_norm)
    if factor < 1.0:
        for p in parameters:
            if p.grad is not None:
                p.grad.mul_(factor)
    return factor


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
