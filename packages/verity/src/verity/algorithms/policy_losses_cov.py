r"""Clip-Cov and KL-Cov (Cui et al. 2025): entropy-preserving variants of the PPO loss.

The paper shows that policy entropy falls in proportion to the covariance
between a token's log-probability and its advantage. Both losses act on the
few tokens with the largest centred covariance

.. math::  \operatorname{Cov}_t = \big(A_t - \bar A\big)\big(\log\pi_\theta(y_t) - \overline{\log\pi_\theta}\big)

(means over the masked-in tokens of THIS call; no gradient). Because the token
selection uses statistics of the local micro-batch, these two losses are not
exactly invariant to how the mini-batch is split (the published algorithms have
the same property). Same signature and notation as ``policy_losses``.
"""

from __future__ import annotations

import torch

from verity.algorithms.aggregation import AggregationContext, aggregate_loss
from verity.algorithms.configs import PolicyLossConfig
from verity.algorithms.masked_ops import masked_mean
from verity.algorithms.policy_loss_common import (
    approx_kl_old_new,
    check_policy_inputs,
    fraction,
    log_ratio,
)
from verity.algorithms.registry import POLICY_LOSSES

Tensor = torch.Tensor


def centered_covariance(advantages: Tensor, logprobs: Tensor, mask: Tensor) -> Tensor:
    """Per-token ``(A - mean A) * (logp - mean logp)`` ``[B, R]``, means over masked-in tokens, no grad."""
    a = advantages.detach()
    lp = logprobs.detach()
    return (a - masked_mean(a, mask)) * (lp - masked_mean(lp, mask))


def selection_size(ratio: float, num_tokens: int) -> int:
    """``max(1, floor(ratio * num_tokens))`` tokens, or 0 when ``ratio`` or ``num_tokens`` is 0."""
    if ratio <= 0 or num_tokens <= 0:
        return 0
    return max(1, int(ratio * num_tokens))


@POLICY_LOSSES.register("clip_cov", "clip-cov")
def clip_cov_loss(
    *,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    agg: AggregationContext,
    config: PolicyLossConfig,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, dict[str, float]]:
    r"""Clip-Cov: the PPO clipped loss, with the gradient of a few high-covariance tokens detached.

    Candidates: masked-in tokens not already clipped by PPO with
    :math:`\text{lb} < \operatorname{Cov}_t < \text{ub}`. From them
    :math:`k = \max(1, \lfloor r N\rfloor)` tokens are drawn uniformly at random
    (:math:`N` masked-in tokens of this call, :math:`r` = ``clip_cov_ratio``;
    fewer if there are fewer candidates; none if :math:`r = 0`). Then

    .. math::
        \ell_t = \begin{cases}\operatorname{sg}[\ell^{\text{clip}}_t] & t \text{ selected}\\
        \ell^{\text{clip}}_t & \text{otherwise}\end{cases}

    with :math:`\ell^{\text{clip}}` PPO's clipped loss (``clip_ratio_low`` /
    ``clip_ratio_high``, no dual-clip). The paper's objective only needs the
    gradient removed; the value is kept so the logged loss stays comparable
    (verl zeroes it). ``generator`` seeds the draw. Config: ``clip_cov_ratio``
    (2e-4), ``clip_cov_lb`` (1), ``clip_cov_ub`` (5). Metrics: ``pg_clipfrac``,
    ``clip_cov_frac`` (fraction of tokens detached), ``ppo_kl``.
    """
    mask = check_policy_inputs(logprobs, old_logprobs, advantages, response_mask, agg, config)
    ratio = torch.exp(log_ratio(logprobs, old_logprobs, config.log_ratio_clamp))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high)
    per_token = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        valid = mask > 0
        clipped_by_ppo = (clipped > unclipped) & valid
        cov = centered_covariance(advantages, logprobs, mask)
        candidates = valid & ~clipped_by_ppo & (cov > config.clip_cov_lb) & (cov < config.clip_cov_ub)
        candidate_index = torch.nonzero(candidates.flatten(), as_tuple=True)[0]
        k = min(selection_size(config.clip_cov_ratio, int(valid.sum().item())), candidate_index.numel())
        order = torch.randperm(candidate_index.numel(), generator=generator)[:k].to(candidate_index.device)
        selected = torch.zeros(candidates.numel(), dtype=torch.bool, device=candidates.device)
        selected[candidate_index[order]] = True
        selected = selected.view_as(candidates)
    per_token = torch.where(selected, per_token.detach(), per_token)
    loss = aggregate_loss(per_token, mask, config.loss_agg_mode, agg)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": fraction(clipped_by_ppo, mask),
            "clip_cov_frac": fraction(selected, mask),
            "ppo_kl": approx_kl_old_new(logprobs, old_logprobs, mask),
        }
    return loss, metrics


@POLICY_LOSSES.register("kl_cov", "kl-cov")
def kl_cov_loss(
    *,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    agg: AggregationContext,
    config: PolicyLossConfig,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, dict[str, float]]:
    r"""KL-Cov: unclipped surrogate, plus a KL penalty on the top-covariance tokens.

    The :math:`k = \max(1, \lfloor r N\rfloor)` masked-in tokens with the largest
    :math:`\operatorname{Cov}_t` (:math:`r` = ``kl_cov_ratio``; none if
    :math:`r = 0`) get

    .. math::  \ell_t = -A_t\rho_t + \beta\,\big|\log\pi_\theta(y_t) - \log\pi_{\text{old}}(y_t)\big|

    and all other tokens :math:`\ell_t = -A_t\rho_t` (no clipping anywhere).
    Config: ``kl_cov_ratio`` (2e-4), ``kl_cov_coef`` (:math:`\beta`, 1). Ties at
    the k-th value are broken by ``torch.topk``. Metrics: ``kl_cov_frac``,
    ``ppo_kl``, ``ppo_kl_abs`` (mean :math:`|\log\rho|`).
    """
    mask = check_policy_inputs(logprobs, old_logprobs, advantages, response_mask, agg, config)
    raw_log_ratio = logprobs - old_logprobs.detach()
    ratio = torch.exp(log_ratio(logprobs, old_logprobs, config.log_ratio_clamp))
    surrogate = -advantages * ratio
    penalised = surrogate + config.kl_cov_coef * raw_log_ratio.abs()
    with torch.no_grad():
        valid = mask > 0
        cov = centered_covariance(advantages, logprobs, mask)
        valid_index = torch.nonzero(valid.flatten(), as_tuple=True)[0]
        k = selection_size(config.kl_cov_ratio, valid_index.numel())
        top = torch.topk(cov.flatten()[valid_index], k).indices if k > 0 else valid_index[:0]
        selected = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
        selected[valid_index[top]] = True
        selected = selected.view_as(valid)
    per_token = torch.where(selected, penalised, surrogate)
    loss = aggregate_loss(per_token, mask, config.loss_agg_mode, agg)
    with torch.no_grad():
        metrics = {
            "kl_cov_frac": fraction(selected, mask),
            "ppo_kl": approx_kl_old_new(logprobs, old_logprobs, mask),
            "ppo_kl_abs": float(masked_mean(raw_log_ratio.detach().abs(), mask).item()),
        }
    return loss, metrics
