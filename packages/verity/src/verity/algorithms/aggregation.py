r"""Loss aggregation: from a per-token loss matrix to one scalar, normalised globally.

A mini-batch (the set of samples behind one optimizer step) is usually split
into micro-batches (gradient accumulation) and data-parallel shards. The
normalisers of every mode are therefore *not* taken from the local tensor but
from an :class:`AggregationContext` computed once over the whole mini-batch:

* ``global_tokens`` :math:`T` — number of response tokens with mask 1;
* ``global_seqs`` :math:`S` — number of sequences with at least one masked-in
  token (a fully masked row, e.g. an overlong response filtered out, is not a
  sequence of the batch for the loss);
* ``max_response_len`` :math:`L` — the configured maximum response length (use
  the config value, not the padded width of one micro-batch, which may differ).

With :math:`\ell_{i,t}` the loss and :math:`m_{i,t}` the mask, :math:`n_i = \sum_t m_{i,t}`,
and :math:`\sum_i` over the rows present in the local tensor:

=========================  ==================================================================
mode                        local contribution
=========================  ==================================================================
token-sum                   :math:`\sum_i\sum_t m_{i,t}\ell_{i,t}` (no normalisation)
token-mean                  :math:`\frac{1}{T}\sum_i\sum_t m_{i,t}\ell_{i,t}`
seq-mean-token-sum          :math:`\frac{1}{S}\sum_i\sum_t m_{i,t}\ell_{i,t}`
seq-mean-token-mean         :math:`\frac{1}{S}\sum_{i: n_i>0}\frac{1}{n_i}\sum_t m_{i,t}\ell_{i,t}`
seq-mean-token-sum-norm     :math:`\frac{1}{S L}\sum_i\sum_t m_{i,t}\ell_{i,t}`
=========================  ==================================================================

``token-sum`` is verl's mode of that name in its global form: the sum of
:math:`m\ell` over every valid token of the mini-batch. verl multiplies it by the
data-parallel size because its gradient reducer averages over ranks; here ranks sum,
so the plain local sum already adds up to the global one.

Every row's contribution depends only on that row and on the global counts,
so the SUM of the aggregated losses of any partition of the mini-batch's rows
(micro-batches, data-parallel shards, or both) equals the aggregated loss of
the whole mini-batch. A trainer therefore sums micro-batch losses (no division
by the number of micro-batches) and sums gradients over data-parallel ranks (if
its collective averages, it multiplies by the world size).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verity.algorithms.masked_ops import masked_sum
from verity.algorithms.registry import AGGREGATION_MODES
from verity.algorithms.tensor_checks import check_mask, check_token_tensor

Tensor = torch.Tensor


@dataclass(frozen=True)
class AggregationContext:
    """Counts over the WHOLE mini-batch (all micro-batches, all data-parallel ranks).

    Attributes:
        global_tokens: number of masked-in response tokens in the mini-batch.
        global_seqs: number of sequences with at least one masked-in token.
        max_response_len: configured maximum response length in tokens.
    """

    global_tokens: float
    global_seqs: float
    max_response_len: int

    def __post_init__(self) -> None:
        for name in ("global_tokens", "global_seqs", "max_response_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"AggregationContext.{name} must be a number, got {type(value).__name__}")
            if value < 0:
                raise ValueError(f"AggregationContext.{name} must be >= 0, got {value}")

    @classmethod
    def from_mask(cls, response_mask: Tensor, max_response_len: int | None = None) -> AggregationContext:
        """Build the context from the response mask ``[B, R]`` of the whole mini-batch.

        ``max_response_len`` defaults to ``R``; pass the configured maximum when
        micro-batches may be trimmed to different widths.
        """
        return cls.from_masks([response_mask], max_response_len)

    @classmethod
    def from_masks(cls, masks: list[Tensor], max_response_len: int | None = None) -> AggregationContext:
        """Build the context from the masks ``[B_k, R_k]`` of all parts of a mini-batch."""
        if not masks:
            raise ValueError("masks must hold at least one [B, R] response mask")
        tokens = 0.0
        seqs = 0.0
        width = 0
        for k, mask in enumerate(masks):
            m = check_mask(f"masks[{k}]", mask)
            tokens += float(m.sum().item())
            seqs += float((m.sum(dim=-1) > 0).sum().item())
            width = max(width, int(m.shape[-1]))
        return cls(tokens, seqs, width if max_response_len is None else int(max_response_len))


def _safe(denominator: float) -> float:
    # A zero count means every mask of the mini-batch is 0, so every numerator
    # is 0 too; dividing by 1 keeps the loss an exact 0 instead of NaN.
    return denominator if denominator > 0 else 1.0


@AGGREGATION_MODES.register("token-sum")
def _token_sum(loss_mat: Tensor, mask: Tensor, ctx: AggregationContext) -> Tensor:
    return masked_sum(loss_mat, mask)


@AGGREGATION_MODES.register("token-mean")
def _token_mean(loss_mat: Tensor, mask: Tensor, ctx: AggregationContext) -> Tensor:
    return masked_sum(loss_mat, mask) / _safe(ctx.global_tokens)


@AGGREGATION_MODES.register("seq-mean-token-sum")
def _seq_mean_token_sum(loss_mat: Tensor, mask: Tensor, ctx: AggregationContext) -> Tensor:
    return masked_sum(loss_mat, mask) / _safe(ctx.global_seqs)


@AGGREGATION_MODES.register("seq-mean-token-mean")
def _seq_mean_token_mean(loss_mat: Tensor, mask: Tensor, ctx: AggregationContext) -> Tensor:
    per_seq_sum = masked_sum(loss_mat, mask, dim=-1)
    per_seq_len = mask.sum(dim=-1)
    per_seq_mean = per_seq_sum / per_seq_len.clamp(min=1.0)  # rows with n_i = 0 have sum 0
    return per_seq_mean.sum() / _safe(ctx.global_seqs)


@AGGREGATION_MODES.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(loss_mat: Tensor, mask: Tensor, ctx: AggregationContext) -> Tensor:
    return masked_sum(loss_mat, mask) / _safe(ctx.global_seqs * ctx.max_response_len)


def aggregate_loss(loss_mat: Tensor, mask: Tensor, mode: str, ctx: AggregationContext) -> Tensor:
    """Aggregate a per-token loss ``[B, R]`` into this part's share of the mini-batch loss.

    Args:
        loss_mat: per-token loss ``[B, R]`` (any unit; the result has the same unit
            per token or per sequence depending on ``mode``).
        mask: ``[B, R]`` 1 on tokens that count, 0 elsewhere.
        mode: one of ``token-sum``, ``token-mean``, ``seq-mean-token-sum``,
            ``seq-mean-token-mean``, ``seq-mean-token-sum-norm`` (formulas in the module docstring).
        ctx: counts over the whole mini-batch.

    Returns:
        a 0-dim tensor; summing it over all parts of the mini-batch gives the
        mini-batch loss.
    """
    fn = AGGREGATION_MODES.get(mode)
    check_token_tensor("loss_mat", loss_mat)
    m = check_mask("mask", mask, like=loss_mat)
    if not isinstance(ctx, AggregationContext):
        raise TypeError(f"ctx must be an AggregationContext, got {type(ctx).__name__}")
    return fn(loss_mat, m, ctx)
