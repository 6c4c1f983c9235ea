r"""Critic loss with value clipping (PPO).

.. math::
    V^{\text{clip}}_t = V^{\text{old}}_t + \operatorname{clip}(V_t - V^{\text{old}}_t, -c, c),\qquad
    \ell_t = \tfrac12\max\big((V_t - G_t)^2,\; (V^{\text{clip}}_t - G_t)^2\big)

then aggregated like the policy loss. With ``cliprange_value=None``,
:math:`\ell_t = \tfrac12 (V_t - G_t)^2`.
"""

from __future__ import annotations

import torch

from verity.algorithms.aggregation import AggregationContext, aggregate_loss
from verity.algorithms.configs import ValueLossConfig
from verity.algorithms.masked_ops import masked_mean
from verity.algorithms.registry import AGGREGATION_MODES
from verity.algorithms.tensor_checks import check_mask, check_token_tensor

Tensor = torch.Tensor


def value_loss(
    *,
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    agg: AggregationContext,
    config: ValueLossConfig | None = None,
) -> tuple[Tensor, dict[str, float]]:
    r"""Clipped value loss (see module docstring for the formula).

    Args:
        values: ``[B, R]`` current critic predictions :math:`V_t` (carry the gradient).
        old_values: ``[B, R]`` predictions of the critic that produced the
            advantages, :math:`V^{\text{old}}_t` (no gradient).
        returns: ``[B, R]`` regression targets :math:`G_t` (no gradient).
        response_mask: ``[B, R]``.
        agg: counts over the whole mini-batch.
        config: ``cliprange_value`` (:math:`c`; 0.5) and ``loss_agg_mode``.

    Returns:
        ``(loss, metrics)``: 0-dim loss (reward units squared); metrics
        ``vf_clipfrac`` (tokens where the clipped branch is larger),
        ``vpred_mean`` and ``vf_explained_var`` (:math:`1 - \operatorname{var}(G - V)/\operatorname{var}(G)`,
        masked; 0 when the returns have no variance).
    """
    config = ValueLossConfig() if config is None else config
    if not isinstance(config, ValueLossConfig):
        raise TypeError(f"config must be a ValueLossConfig, got {type(config).__name__}")
    config.validate()
    AGGREGATION_MODES.get(config.loss_agg_mode)
    check_token_tensor("values", values)
    check_token_tensor("old_values", old_values, like=values)
    check_token_tensor("returns", returns, like=values)
    mask = check_mask("response_mask", response_mask, like=values)
    if not isinstance(agg, AggregationContext):
        raise TypeError(f"agg must be an AggregationContext, got {type(agg).__name__}")
    returns = returns.detach()
    unclipped = (values - returns) ** 2
    if config.cliprange_value is None:
        per_token = unclipped
        clipped_larger = torch.zeros_like(mask, dtype=torch.bool)
    else:
        old = old_values.detach()
        clipped_values = old + (values - old).clamp(-config.cliprange_value, config.cliprange_value)
        clipped = (clipped_values - returns) ** 2
        per_token = torch.maximum(unclipped, clipped)
        clipped_larger = clipped > unclipped
    loss = 0.5 * aggregate_loss(per_token, mask, config.loss_agg_mode, agg)
    with torch.no_grad():
        v = values.detach()
        residual = returns - v
        var_returns = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
        var_residual = masked_mean((residual - masked_mean(residual, mask)) ** 2, mask)
        explained = 1.0 - var_residual / var_returns if float(var_returns.item()) > 0 else torch.zeros(())
        metrics = {
            "vf_clipfrac": float(masked_mean(clipped_larger.to(mask.dtype), mask).item()),
            "vpred_mean": float(masked_mean(v, mask).item()),
            "vf_explained_var": float(explained.item()),
        }
    return loss, metrics
