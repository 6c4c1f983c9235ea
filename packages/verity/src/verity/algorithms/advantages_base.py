"""Shared pieces of the advantage estimators: the registration record and group statistics.

An estimator is registered with the inputs it needs (group ids, critic values,
baseline scores); ``compute_advantages`` checks that they were given before it
calls the estimator. Every estimator has the same keyword-only signature::

    fn(*, token_rewards, response_mask, group, values, baseline_scores, config)
        -> (advantages [B, R], returns [B, R])

and ignores the inputs it does not use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from verity.algorithms.registry import ADVANTAGE_ESTIMATORS

Tensor = torch.Tensor


@dataclass(frozen=True)
class AdvantageEstimatorSpec:
    """A registered estimator and the optional inputs it requires."""

    fn: Callable[..., tuple[Tensor, Tensor]]
    needs_group: bool = False
    needs_values: bool = False
    needs_baseline_scores: bool = False
    # the algorithm.advantage keys it reads (gamma, lam, norm_by_std, ...); None: not declared
    # (a plug-in's estimator), and then no key is rejected as idle for it
    reads: tuple[str, ...] | None = None


def register_advantage_estimator(
    name: str,
    *aliases: str,
    needs_group: bool = False,
    needs_values: bool = False,
    needs_baseline_scores: bool = False,
    reads: tuple[str, ...] | None = None,
) -> Callable[[Callable[..., tuple[Tensor, Tensor]]], Callable[..., tuple[Tensor, Tensor]]]:
    """Decorator: register an estimator under ``name`` (and aliases) with its input needs.

    ``reads``: the ``AdvantageConfig`` fields the estimator reads; a run that sets another
    estimator-specific field (``gamma``, ``lam``, ...) away from its default is then rejected
    (:mod:`verity.config.idle_settings`). None: not declared, nothing rejected.
    """

    def decorator(fn: Callable[..., tuple[Tensor, Tensor]]) -> Callable[..., tuple[Tensor, Tensor]]:
        spec = AdvantageEstimatorSpec(
            fn, needs_group, needs_values, needs_baseline_scores, None if reads is None else tuple(reads)
        )
        ADVANTAGE_ESTIMATORS.add(name, spec, *aliases)
        return fn

    return decorator


@dataclass(frozen=True)
class GroupStats:
    """Per-sample view of the statistics of each sample's group, all ``[B]`` float64.

    ``std`` is the unbiased (n - 1) standard deviation, 0 for groups of one.
    """

    inverse: Tensor  # [B] int64, index of the sample's group in 0..G-1
    num_groups: int
    count: Tensor
    sum: Tensor
    mean: Tensor
    std: Tensor
    max: Tensor
    min: Tensor


def group_stats(scores: Tensor, group: Tensor) -> GroupStats:
    """Statistics of ``scores [B]`` within the groups given by ``group [B]`` (int ids).

    Computed in float64 so that equal scores give an exactly zero deviation.
    """
    x = scores.to(torch.float64)
    _, inverse = torch.unique(group, return_inverse=True)
    num_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    zeros = torch.zeros(num_groups, dtype=torch.float64, device=x.device)
    count = zeros.index_add(0, inverse, torch.ones_like(x))
    total = zeros.index_add(0, inverse, x)
    mean = total / count
    deviation = x - mean[inverse]
    sq = zeros.index_add(0, inverse, deviation * deviation)
    var = torch.where(count > 1, sq / (count - 1).clamp(min=1.0), torch.zeros_like(sq))
    gmax = zeros.scatter_reduce(0, inverse, x, reduce="amax", include_self=False)
    gmin = zeros.scatter_reduce(0, inverse, x, reduce="amin", include_self=False)
    return GroupStats(
        inverse=inverse,
        num_groups=num_groups,
        count=count[inverse],
        sum=total[inverse],
        mean=mean[inverse],
        std=var.sqrt()[inverse],
        max=gmax[inverse],
        min=gmin[inverse],
    )


def sequence_scores(token_rewards: Tensor) -> Tensor:
    """Sequence score ``[B]`` = sum of ``token_rewards [B, R]`` over the response axis."""
    return token_rewards.sum(dim=-1)


def broadcast_over_tokens(per_sequence: Tensor, response_mask: Tensor) -> Tensor:
    """``[B]`` -> ``[B, R]``: the value on every masked-in token, 0 elsewhere (mask's dtype)."""
    return per_sequence.to(response_mask.dtype).unsqueeze(-1) * response_mask
