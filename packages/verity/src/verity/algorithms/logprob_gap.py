r"""The sampler-vs-trainer log-prob gap: how far the trainer's forward is from the rollout's.

Before an update the trainer recomputes the behaviour log-probs :math:`\log\pi_{\text{old}}`
of the sampled tokens (``old_logprobs``) with the very weights the rollout sampled with (in a
synchronous run). The sampler recorded its own, :math:`\log\mu` (``rollout_logprobs``). With the
same weights the two differ only where the two forwards compute differently: another dtype,
kernels, batch shape, or an MoE router choosing other experts. The gap

.. math::
    g = \frac{\sum_{b,t} m_{bt}\,\lvert \log\pi_{\text{old}}(y_{bt}) - \log\mu(y_{bt}) \rvert}
             {\sum_{b,t} m_{bt}}

is measured on the workers that hold the rows (the rollout log-probs may never leave them), as
per-row sums and token counts, and reduced on the driver into a token-weighted mean over every
rank's rows: :func:`row_gaps` on a worker, :func:`gap_metrics` on the driver.
"""

from __future__ import annotations

import torch

#: the per-row keys a worker answers and the driver reduces (declared in verity.batch.schema)
GAP_SUM_KEY = "rollout_logprob_gap_sum"
GAP_TOKENS_KEY = "rollout_logprob_gap_tokens"
GAP_MAX_KEY = "rollout_logprob_gap_row_max"
GAP_ROW_KEYS = (GAP_SUM_KEY, GAP_TOKENS_KEY, GAP_MAX_KEY)


def row_gaps(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per-row parts of the gap, ``|old_logprobs - rollout_logprobs|`` over the response tokens.

    Args:
        old_logprobs: ``[B, R]`` the trainer's log-probs of the response tokens (nats).
        rollout_logprobs: ``[B, R]`` the sampler's log-probs of the same tokens (nats).
        response_mask: ``[B, R]`` 1 on the tokens that count (the model's own tokens).

    Returns:
        float32 ``[B]`` tensors under :data:`GAP_ROW_KEYS`: the sum of the absolute
        difference over the row's counted tokens (nats), their number, and the largest
        absolute difference on one of them (0 for a row with none).
    """
    if old_logprobs.shape != rollout_logprobs.shape or old_logprobs.shape != response_mask.shape:
        raise ValueError(
            f"shapes differ: old_logprobs {tuple(old_logprobs.shape)}, rollout_logprobs "
            f"{tuple(rollout_logprobs.shape)}, response_mask {tuple(response_mask.shape)}"
        )
    keep = response_mask > 0
    diff = (old_logprobs.detach().float() - rollout_logprobs.float()).abs()
    diff = torch.where(keep, diff, torch.zeros_like(diff))  # a masked inf or NaN never counts
    return {
        GAP_SUM_KEY: diff.sum(-1),
        GAP_TOKENS_KEY: keep.sum(-1).float(),
        GAP_MAX_KEY: diff.amax(-1) if diff.shape[-1] else torch.zeros(diff.shape[0]),
    }


def gap_metrics(sums: torch.Tensor, tokens: torch.Tensor, maxes: torch.Tensor) -> dict[str, float]:
    """``actor/rollout_logprob_gap`` (token mean, nats) and ``actor/rollout_logprob_gap_max`` (worst token).

    Args:
        sums, tokens, maxes: ``[B]`` the per-row parts of :func:`row_gaps`, every rank's rows.

    Returns:
        the two metrics; empty when no row has a counted token.
    """
    total = float(tokens.sum())
    if total <= 0:
        return {}
    return {
        "actor/rollout_logprob_gap": float(sums.sum()) / total,
        "actor/rollout_logprob_gap_max": float(maxes.max()),
    }
