"""Helpers shared by the policy losses: input checks, clamped log-ratio, metric reductions."""

from __future__ import annotations

import torch

from verity.algorithms.aggregation import AggregationContext
from verity.algorithms.configs import PolicyLossConfig
from verity.algorithms.masked_ops import masked_mean
from verity.algorithms.registry import AGGREGATION_MODES
from verity.algorithms.tensor_checks import check_mask, check_token_tensor

Tensor = torch.Tensor


def check_policy_inputs(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    agg: AggregationContext,
    config: PolicyLossConfig,
) -> Tensor:
    """Validate the common inputs of a policy loss; return the mask as a float tensor."""
    check_token_tensor("logprobs", logprobs)
    check_token_tensor("old_logprobs", old_logprobs, like=logprobs)
    check_token_tensor("advantages", advantages, like=logprobs)
    mask = check_mask("response_mask", response_mask, like=logprobs)
    if not isinstance(agg, AggregationContext):
        raise TypeError(f"agg must be an AggregationContext, got {type(agg).__name__}")
    if not isinstance(config, PolicyLossConfig):
        raise TypeError(f"config must be a PolicyLossConfig, got {type(config).__name__}")
    AGGREGATION_MODES.get(config.loss_agg_mode)
    config.validate()
    return mask


def log_ratio(logprobs: Tensor, old_logprobs: Tensor, clamp: float) -> Tensor:
    """``clamp(logprobs - old_logprobs, -clamp, clamp)``, ``[B, R]``."""
    return (logprobs - old_logprobs.detach()).clamp(-clamp, clamp)


def approx_kl_old_new(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> float:
    """Masked mean of ``old_logprobs - logprobs`` (k1 estimate of KL(old || new))."""
    return float(masked_mean((old_logprobs - logprobs).detach(), mask).item())


def fraction(condition: Tensor, mask: Tensor) -> float:
    """Fraction of masked-in tokens where ``condition`` holds."""
    return float(masked_mean(condition.to(mask.dtype), mask).item())
