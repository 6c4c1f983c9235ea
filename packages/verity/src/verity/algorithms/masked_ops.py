"""Masked reductions used by the estimators and losses.

All functions take a value tensor and a 0/1 mask of the same shape (float);
positions with mask 0 do not contribute.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``values * mask`` over ``dim`` (all dims when ``None``).

    Masked positions are excluded with ``torch.where`` rather than a product, so
    a NaN or inf sitting on a masked position cannot leak into the result.
    """
    kept = torch.where(mask > 0, values * mask, torch.zeros_like(values))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean over the masked-in positions; 0 where no position is masked in."""
    total = masked_sum(values, mask, dim)
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return total / count.clamp(min=1.0)


def masked_whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    r"""Whiten ``values`` over all masked-in positions of the tensor.

    .. math::  \tilde x = (x - \mu) / \sqrt{\sigma^2 + \varepsilon}

    where :math:`\mu` is the masked mean and :math:`\sigma^2` the *unbiased*
    masked variance :math:`\sum m (x-\mu)^2 / (N-1)` over the :math:`N` masked-in
    positions. With :math:`N < 2` the variance is taken as 0. Masked-out
    positions of the result are 0. Shapes: ``values`` and ``mask`` any equal
    shape; the result has that shape.
    """
    count = mask.sum()
    mean = masked_sum(values, mask) / count.clamp(min=1.0)
    centered = (values - mean) * mask
    sq = masked_sum(centered * centered, mask)
    var = sq / (count - 1.0) if count.item() >= 2 else torch.zeros_like(sq)
    return centered * torch.rsqrt(var + eps) * mask
