r"""Truncated importance weights: correcting for a behaviour policy that is not the proximal one.

A sample drawn by the rollout's policy :math:`\mu` (its log-probs recorded as
``rollout_logprobs``) is trained with the PPO ratio against a *proximal* policy
:math:`\pi_{\text{old}}` (``old_logprobs``: the trainer's own forward before the update,
or the update's own forward, detached, in an on-policy run). When the two differ — a
different sampler (bf16 vLLM against an fp32 trainer), or a batch generated one or more
updates ago (``trainer.mode=async``) — the policy gradient is biased. Each token's
loss is multiplied by the truncated importance weight

.. math::
    w_t = \min\!\Big(\frac{\pi_{\text{old}}(y_t)}{\mu(y_t)},\; C\Big)
        = \min\!\big(\exp(\log\pi_{\text{old}}(y_t) - \log\mu(y_t)),\; C\big),

a constant (no gradient) capped at :math:`C` = ``actor.off_policy.is_cap`` so that a
token the sampler found unlikely cannot dominate the batch (the bias of the cap trades
for bounded variance). The per-token loss :math:`\ell_t` becomes :math:`w_t\,\ell_t`.
Every built-in policy loss is positively homogeneous in the advantage
(:math:`\ell_t(wA) = w\,\ell_t(A)` for :math:`w \ge 0`, the PPO clip and dual clip
included), so the weight is applied as :math:`A_t \to w_t A_t`.
"""

from __future__ import annotations

import torch

LOG_RATIO_LIMIT = 20.0  # exp(20) ~ 5e8: far above any useful cap, and no overflow


def truncated_importance_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    cap: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``w = min(exp(old_logprobs - rollout_logprobs), cap)`` per token, 0 outside the response.

    Args:
        old_logprobs: ``[B, R]`` log-probs of the proximal policy (float, no gradient needed).
        rollout_logprobs: ``[B, R]`` log-probs the sampler recorded for the same tokens.
        response_mask: ``[B, R]`` 1 on response tokens that count in the loss.
        cap: ``C > 0``, the largest weight.

    Returns:
        ``(weights [B, R] detached, metrics)`` with ``is_weight_mean`` (mean of ``w`` over
        response tokens), ``is_ratio_mean`` (mean of the uncapped ratio) and
        ``is_capped_frac`` (share of response tokens whose ratio exceeded the cap).
    """
    if cap <= 0:
        raise ValueError(f"the importance-weight cap must be > 0, got {cap}")
    if old_logprobs.shape != rollout_logprobs.shape or old_logprobs.shape != response_mask.shape:
        raise ValueError(
            f"shapes differ: old_logprobs {tuple(old_logprobs.shape)}, rollout_logprobs "
            f"{tuple(rollout_logprobs.shape)}, response_mask {tuple(response_mask.shape)}"
        )
    mask = response_mask.to(old_logprobs.dtype)
    log_ratio = (old_logprobs.detach() - rollout_logprobs.to(old_logprobs.dtype)).clamp(
        -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT
    )
    ratio = torch.exp(log_ratio)
    weights = ratio.clamp(max=cap) * mask
    tokens = mask.sum().clamp(min=1.0)
    metrics = {
        "is_weight_mean": float(weights.sum() / tokens),
        "is_ratio_mean": float((ratio * mask).sum() / tokens),
        "is_capped_frac": float(((ratio > cap).to(mask.dtype) * mask).sum() / tokens),
    }
    return weights.detach(), metrics
