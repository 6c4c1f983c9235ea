"""The actor's loss: policy loss + optional KL loss against the reference − entropy bonus.

For a micro-batch with response mask :math:`m`, the loss the engine back-propagates is

.. math::
    \\mathcal{L} = \\mathcal{L}_{\\text{policy}}(\\log\\pi, \\log\\pi_{\\text{old}}, A)
        + \\beta_{\\text{KL}}\\,\\operatorname{agg}\\big(\\mathrm{KL}(\\log\\pi, \\log\\pi_{\\text{ref}})\\big)
        - c_H\\,\\operatorname{agg}(H)

where every term is aggregated with the same mode and the same global
:class:`~verity.algorithms.aggregation.AggregationContext` (counts over the whole
mini-batch across ranks), so the sum over micro-batches and ranks is the
mini-batch loss whatever the micro-batch size and number of workers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from verity.algorithms.aggregation import aggregate_loss
from verity.algorithms.configs import KLConfig, PolicyLossConfig
from verity.algorithms.kl import kl_loss
from verity.algorithms.off_policy import truncated_importance_weights
from verity.algorithms.policy_losses import get_policy_loss

ActorLossFn = Callable[[Any, torch.Tensor, torch.Tensor, Any], tuple[torch.Tensor, dict[str, float]]]


def make_actor_loss(
    policy: PolicyLossConfig, kl: KLConfig, entropy_coeff: float, is_cap: float = 0.0
) -> ActorLossFn:
    """Build ``loss_fn(micro_batch, logprobs [b,R], entropy [b,R], agg) -> (loss, metrics)``.

    ``micro_batch`` must hold ``advantages`` and ``response_mask`` (``[b, R]``), and
    ``ref_logprobs`` when ``kl.use_kl_loss``. Its ``old_logprobs`` are the behaviour
    log-probs; without them (an on-policy run that skipped the recomputation) the
    forward's own log-probs, detached, stand in: ratio 1, and the same gradient a
    recomputation gives. ``actor/behaviour_logprob_gap`` is the token mean of
    ``|log pi - log pi_old|`` (0 without ``old_logprobs``; with ``rollout_logprobs``
    as the behaviour, the sampler-vs-trainer mismatch plus any update since). Metrics are
    micro-batch token means (the engine averages them over micro-batches and ranks).

    ``is_cap > 0`` (``actor.off_policy.is_cap``): every token's policy loss is weighted by the
    truncated importance weight ``min(pi_old / pi_rollout, is_cap)`` against the micro-batch's
    ``rollout_logprobs`` (:mod:`verity.algorithms.off_policy`), applied to the advantages.
    """
    policy_loss = get_policy_loss(policy.name)

    def loss_fn(micro: Any, logprobs: torch.Tensor, entropy: torch.Tensor, agg: Any):
        mask = micro["response_mask"].to(logprobs.dtype)
        old = micro["old_logprobs"].to(logprobs.dtype) if "old_logprobs" in micro else logprobs.detach()
        advantages = micro["advantages"].to(logprobs.dtype)
        is_metrics: dict[str, float] = {}
        if is_cap > 0:
            if "rollout_logprobs" not in micro:
                raise RuntimeError("actor.off_policy.is_cap > 0 needs rollout_logprobs in the update's batch")
            weights, is_metrics = truncated_importance_weights(old, micro["rollout_logprobs"], mask, is_cap)
            advantages = advantages * weights
        loss, metrics = policy_loss(
            logprobs=logprobs,
            old_logprobs=old,
            advantages=advantages,
            response_mask=mask,
            agg=agg,
            config=policy,
        )
        metrics = {f"actor/{k}": float(v) for k, v in {**metrics, **is_metrics}.items()}
        metrics["actor/pg_loss"] = float(loss.detach())
        gap = ((logprobs.detach() - old).abs() * mask).sum() / mask.sum().clamp(min=1.0)
        metrics["actor/behaviour_logprob_gap"] = float(gap)
        if kl.use_kl_loss:
            kl_term, kl_metrics = kl_loss(
                logprobs=logprobs,
                ref_logprobs=micro["ref_logprobs"].to(logprobs.dtype),
                response_mask=mask,
                agg=agg,
                kind=kl.kl_loss_kind,
                loss_agg_mode=policy.loss_agg_mode,
                clamp=kl.kl_clamp,
            )
            loss = loss + kl.kl_loss_coef * kl_term
            metrics["actor/kl_loss"] = kl_metrics["kl_loss"]
        if entropy_coeff:
            loss = loss - entropy_coeff * aggregate_loss(entropy, mask, policy.loss_agg_mode, agg)
        return loss, metrics

    return loss_fn
