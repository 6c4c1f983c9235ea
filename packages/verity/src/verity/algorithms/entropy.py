r"""Token entropy of the policy, computed from logits, and the entropy bonus term.

.. math::  H(z) = -\sum_v p_v\log p_v = \operatorname{logsumexp}(z) - \sum_v p_v z_v,\qquad p = \operatorname{softmax}(z)

The right-hand form never takes the log of a probability, so it is stable for
peaked distributions; logits equal to ``-inf`` (banned tokens) contribute 0.
"""

from __future__ import annotations

import torch

from verity.algorithms.aggregation import AggregationContext, aggregate_loss
from verity.algorithms.masked_ops import masked_mean
from verity.algorithms.registry import AGGREGATION_MODES
from verity.algorithms.tensor_checks import check_mask, check_positive, check_tensor, check_token_tensor

Tensor = torch.Tensor


def _entropy_rows(logits: Tensor) -> Tensor:
    z = logits.float()
    probs = torch.softmax(z, dim=-1)
    finite_z = torch.where(torch.isfinite(z), z, torch.zeros_like(z))
    return torch.logsumexp(z, dim=-1) - (probs * finite_z).sum(dim=-1)


def entropy_from_logits(logits: Tensor, chunk_size: int | None = None) -> Tensor:
    """Entropy in nats of the softmax over the last axis.

    Args:
        logits: ``[..., V]`` (any float dtype; computed in float32).
        chunk_size: process this many rows (positions) at a time to bound the
            float32 ``[rows, V]`` temporaries; ``None`` processes all at once.
            Under autograd each chunk's graph is kept, so chunking saves memory
            mainly when called under ``torch.no_grad()``.

    Returns:
        ``[...]`` float32 entropies.
    """
    check_tensor("logits", logits, floating=True)
    if logits.dim() < 1:
        raise ValueError("logits must have at least one dimension (the vocabulary axis)")
    if chunk_size is None:
        return _entropy_rows(logits)
    check_positive("chunk_size", chunk_size)
    leading = logits.shape[:-1]
    rows = logits.reshape(-1, logits.shape[-1])
    parts = [_entropy_rows(rows[i : i + chunk_size]) for i in range(0, rows.shape[0], chunk_size)]
    flat = torch.cat(parts) if parts else rows.new_zeros(0, dtype=torch.float32)
    return flat.reshape(leading)


def entropy_bonus(
    *,
    entropy: Tensor,
    response_mask: Tensor,
    agg: AggregationContext,
    loss_agg_mode: str = "token-mean",
    coef: float,
) -> tuple[Tensor, dict[str, float]]:
    r"""Entropy bonus as a loss term to ADD to the actor loss: :math:`-c\cdot\operatorname{agg}(H)`.

    Args:
        entropy: ``[B, R]`` token entropies in nats (from :func:`entropy_from_logits`, with grad).
        response_mask: ``[B, R]``.
        agg: counts over the whole mini-batch.
        loss_agg_mode: aggregation mode (normally the policy loss's).
        coef: :math:`c \ge 0`.

    Returns:
        ``(loss, {"entropy": masked mean entropy})``.
    """
    check_token_tensor("entropy", entropy)
    mask = check_mask("response_mask", response_mask, like=entropy)
    AGGREGATION_MODES.get(loss_agg_mode)
    check_positive("coef", coef, allow_zero=True)
    loss = -coef * aggregate_loss(entropy, mask, loss_agg_mode, agg)
    with torch.no_grad():
        metrics = {"entropy": float(masked_mean(entropy.detach(), mask).item())}
    return loss, metrics
