r"""Policy losses: PPO clip (clip-higher, dual-clip), GSPO, GPG, CISPO.

Every loss has the same keyword-only signature::

    loss_fn(*, logprobs, old_logprobs, advantages, response_mask, agg, config, generator=None)
        -> (loss: 0-dim tensor, metrics: dict[str, float])

``logprobs [B, R]`` carries the gradient (current policy); ``old_logprobs [B, R]``
are the behaviour policy's log-probs (no gradient); ``advantages [B, R]``;
``response_mask [B, R]``; ``agg`` the :class:`AggregationContext` of the whole
mini-batch; ``config`` a :class:`PolicyLossConfig` whose ``loss_agg_mode``
chooses the aggregation; ``generator`` seeds the losses that sample (Clip-Cov)
and is ignored by the others. Notation: :math:`\rho_t = \exp(\log\pi_\theta(y_t) -
\log\pi_{\text{old}}(y_t))` (log-ratio clamped to ``[-log_ratio_clamp,
log_ratio_clamp]`` before ``exp`` to avoid overflow), :math:`A_t` the advantage,
:math:`\ell_t` the per-token loss that is then aggregated.

Metrics are masked means over this call's tokens (diagnostics, not
aggregated globally): ``ppo_kl`` = mean of :math:`\log\pi_{\text{old}} -
\log\pi_\theta` (k1 estimate of KL(old || new)), and loss-specific clip fractions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Importing the covariance-based losses registers them alongside the ones below.
from verity.algorithms import policy_losses_cov as _policy_losses_cov  # noqa: F401
from verity.algorithms.aggregation import AggregationContext, aggregate_loss
from verity.algorithms.configs import PolicyLossConfig
from verity.algorithms.masked_ops import masked_sum
from verity.algorithms.policy_loss_common import (
    approx_kl_old_new,
    check_policy_inputs,
    fraction,
    log_ratio,
)
from verity.algorithms.registry import POLICY_LOSSES

Tensor = torch.Tensor
PolicyLossFn = Callable[..., tuple[Tensor, dict[str, float]]]


def get_policy_loss(name: str) -> PolicyLossFn:
    """Return the policy loss registered as ``name``; unknown names list the known ones."""
    return POLICY_LOSSES.get(name)


@POLICY_LOSSES.register("ppo", "vanilla")
def ppo_clip_loss(
    *,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    agg: AggregationContext,
    config: PolicyLossConfig,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, dict[str, float]]:
    r"""PPO clipped surrogate (Schulman et al. 2017) with clip-higher (Yu et al. 2025) and
    optional dual-clip (Ye et al. 2020).

    .. math::
        \ell^{\text{clip}}_t = \max\big(-A_t\rho_t,\; -A_t\,\operatorname{clip}(\rho_t, 1-\epsilon_{\text{low}},
        1+\epsilon_{\text{high}})\big)

    .. math::
        \ell_t = \begin{cases} \min(\ell^{\text{clip}}_t,\; -c\,A_t) & A_t < 0 \text{ and dual-clip on} \\
        \ell^{\text{clip}}_t & \text{otherwise}\end{cases}

    Config: ``clip_ratio_low`` (:math:`\epsilon_{\text{low}}`), ``clip_ratio_high``
    (:math:`\epsilon_{\text{high}}`), ``clip_ratio_c`` (:math:`c > 1`; ``None``
    disables dual-clip), ``loss_agg_mode``. Metrics: ``pg_clipfrac`` (tokens
    where the clipped branch is taken), ``pg_clipfrac_lower`` (tokens bounded by
    dual-clip), ``ppo_kl``.
    """
    mask = check_policy_inputs(logprobs, old_logprobs, advantages, response_mask, agg, config)
    ratio = torch.exp(log_ratio(logprobs, old_logprobs, config.log_ratio_clamp))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high)
    clip_loss = torch.maximum(unclipped, clipped)
    per_token = clip_loss
    lower_bounded = torch.zeros_like(mask, dtype=torch.bool)
    if config.clip_ratio_c is not None:
        dual_bound = -advantages * config.clip_ratio_c
        negative = advantages < 0
        per_token = torch.where(negative, torch.minimum(clip_loss, dual_bound), clip_loss)
        lower_bounded = negative & (clip_loss > dual_bound)
    loss = aggregate_loss(per_token, mask, config.loss_agg_mode, agg)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": fraction(clipped > unclipped, mask),
            "pg_clipfrac_lower": fraction(lower_bounded, mask),
            "ppo_kl": approx_kl_old_new(logprobs, old_logprobs, mask),
        }
    return loss, metrics


@POLICY_LOSSES.register("gspo")
def gspo_loss(
    *,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    agg: AggregationContext,
    config: PolicyLossConfig,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, dict[str, float]]:
    r"""GSPO (Zheng et al. 2025): clip a length-normalised SEQUENCE ratio.

    .. math::
        s_i = \exp\Big(\frac{1}{|y_i|}\sum_t m_{i,t}\big(\log\pi_\theta(y_{i,t}) - \log\pi_{\text{old}}(y_{i,t})\big)\Big)

    Token form (GSPO-token), which allows token-level advantages and equals GSPO
    in value and gradient when :math:`A` is constant over a sequence and the
    aggregation is ``seq-mean-token-mean`` (the paper's):

    .. math::
        s_{i,t} = \operatorname{sg}[s_i]\,\frac{\pi_\theta(y_{i,t})}{\operatorname{sg}[\pi_\theta(y_{i,t})]},\qquad
        \ell_{i,t} = \max\big(-A_{i,t}s_{i,t},\; -A_{i,t}\operatorname{clip}(s_{i,t}, 1-\epsilon_{\text{low}},
        1+\epsilon_{\text{high}})\big)

    Config: ``gspo_clip_ratio_low`` / ``gspo_clip_ratio_high`` (paper: 3e-4 / 4e-4),
    ``loss_agg_mode`` (use ``seq-mean-token-mean`` for the paper's objective).
    Metrics: ``pg_clipfrac`` (tokens in clipped sequences), ``ppo_kl``,
    ``gspo_seq_ratio_mean`` (mean :math:`s_i` over non-empty rows).
    """
    mask = check_policy_inputs(logprobs, old_logprobs, advantages, response_mask, agg, config)
    lengths = mask.sum(dim=-1)
    seq_log_ratio = masked_sum(logprobs - old_logprobs.detach(), mask, dim=-1) / lengths.clamp(min=1.0)
    token_log_ratio = seq_log_ratio.detach().unsqueeze(-1) + logprobs - logprobs.detach()
    ratio = torch.exp(token_log_ratio.clamp(-config.log_ratio_clamp, config.log_ratio_clamp))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - config.gspo_clip_ratio_low, 1.0 + config.gspo_clip_ratio_high)
    per_token = torch.maximum(unclipped, clipped)
    loss = aggregate_loss(per_token, mask, config.loss_agg_mode, agg)
    with torch.no_grad():
        nonempty = lengths > 0
        seq_ratio = torch.exp(seq_log_ratio.detach())
        seq_ratio_mean = float(seq_ratio[nonempty].mean().item()) if bool(nonempty.any()) else 1.0
        metrics = {
            "pg_clipfrac": fraction(clipped > unclipped, mask),
            "ppo_kl": approx_kl_old_new(logprobs, old_logprobs, mask),
            "gspo_seq_ratio_mean": seq_ratio_mean,
        }
    return loss, metrics


@POLICY_LOSSES.register("gpg")
def gpg_loss(
    *,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    agg: AggregationContext,
    config: PolicyLossConfig,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, dict[str, float]]:
    r"""GPG (Chu et al. 2025): plain policy gradient, no ratio, no clipping.

    .. math::  \ell_t = -A_t \log\pi_\theta(y_t)

    The paper aggregates with ``token-mean``. ``old_logprobs`` only feeds the
    ``ppo_kl`` metric. Config: ``loss_agg_mode``.
    """
    mask = check_policy_inputs(logprobs, old_logprobs, advantages, response_mask, agg, config)
    per_token = -advantages * logprobs
    loss = aggregate_loss(per_token, mask, config.loss_agg_mode, agg)
    with torch.no_grad():
        metrics = {"ppo_kl": approx_kl_old_new(logprobs, old_logprobs, mask)}
    return loss, metrics


@POLICY_LOSSES.register("cispo")
def cispo_loss(
    *,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    agg: AggregationContext,
    config: PolicyLossConfig,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, dict[str, float]]:
    r"""CISPO (MiniMax 2025): clip the importance-sampling WEIGHT, keep every token's gradient.

    .. math::
        \hat\rho_t = \operatorname{clip}(\rho_t, 1-\epsilon^{IS}_{\text{low}}, 1+\epsilon^{IS}_{\text{high}}),\qquad
        \ell_t = -\operatorname{sg}[\hat\rho_t]\,A_t\,\log\pi_\theta(y_t)

    so :math:`\nabla\ell_t = -\hat\rho_t A_t \nabla\log\pi_\theta(y_t)`. Config:
    ``cispo_clip_ratio_low`` (``None``: no lower bound, as in the paper),
    ``cispo_clip_ratio_high``, ``loss_agg_mode`` (the paper uses ``token-mean``).
    Metrics: ``cispo_clipfrac`` (tokens whose weight was clipped), ``ppo_kl``.
    """
    mask = check_policy_inputs(logprobs, old_logprobs, advantages, response_mask, agg, config)
    ratio = torch.exp(log_ratio(logprobs, old_logprobs, config.log_ratio_clamp)).detach()
    low = 0.0 if config.cispo_clip_ratio_low is None else 1.0 - config.cispo_clip_ratio_low
    high = 1.0 + config.cispo_clip_ratio_high
    # 0 off the mask, so a non-finite log-prob on a padded position cannot leak into the gradient
    weight = torch.where(mask > 0, ratio.clamp(min=low, max=high), torch.zeros_like(ratio))
    per_token = -weight * advantages * logprobs
    loss = aggregate_loss(per_token, mask, config.loss_agg_mode, agg)
    with torch.no_grad():
        metrics = {
            "cispo_clipfrac": fraction((ratio > high) | (ratio < low), mask),
            "ppo_kl": approx_kl_old_new(logprobs, old_logprobs, mask),
        }
    return loss, metrics
