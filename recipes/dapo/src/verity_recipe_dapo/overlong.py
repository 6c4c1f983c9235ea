r"""Overlong reward shaping and overlong filtering (DAPO, Yu et al. 2025, section 3.4).

**Soft overlong punishment.** With the response budget :math:`L_{max}` =
``data.max_response_length`` tokens and a punishment buffer of :math:`L_{cache}` =
``dapo.overlong_shaping.buffer_len`` tokens, a response of :math:`|y|` tokens (EOS
included) gets, added to its rule reward,

.. math::
    R_{length}(y) = \begin{cases}
        0 & |y| \le L_{max} - L_{cache} \\
        \frac{(L_{max} - L_{cache}) - |y|}{L_{cache}} & L_{max} - L_{cache} < |y| \le L_{max} \\
        -1 & L_{max} < |y|
    \end{cases}

times ``penalty_factor`` (the paper's is 1). The penalty grows linearly from 0 at the
start of the buffer to ``-penalty_factor`` at the end of the budget; a response the
rollout cut at the budget (:math:`|y| = L_{max}`) gets the full ``-penalty_factor``.

**Overlong filtering.** A *truncated* response — it used the whole budget without
ending in EOS — carries a reward that judges an unfinished answer. With
``dapo.overlong_filter.enabled`` its tokens are masked out of the policy loss (its
``response_mask`` is zero in the update only; metrics, rewards and the group's advantage
statistics still see it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from verity.batch import Batch
from verity.rewards.manager import token_rewards_from_scores
from verity.trainer.stages import StepContext, update_actor


def overlong_penalty(
    lengths: torch.Tensor, max_length: int, buffer_len: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """The soft overlong punishment ``penalty_factor * R_length(y)`` (module docstring) per response.

    Args:
        lengths: ``[B]`` response lengths in tokens (EOS included), any real dtype.
        max_length: ``L_max``, the response budget in tokens.
        buffer_len: ``L_cache``, tokens before ``L_max`` over which the penalty grows (``1 <= buffer_len``).
        penalty_factor: the penalty's size at ``L_max`` (>= 0).
    Returns:
        ``[B]`` float32 penalties in ``[-penalty_factor, 0]``.
    """
    if buffer_len < 1:
        raise ValueError(f"buffer_len: expected >= 1 token, got {buffer_len}")
    expected = max_length - buffer_len
    exceed = (lengths.float() - expected).clamp(min=0.0)
    return -(exceed / buffer_len).clamp(max=1.0) * penalty_factor


def tokenizer_eos_ids(ctx: StepContext) -> list[int] | None:
    """The EOS token ids of the run's tokenizer (the reward manager holds it), or None without one."""
    eos = getattr(getattr(ctx.rewards, "tokenizer", None), "eos_token_id", None)
    if eos is None:
        return None
    return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]


def eos_ids(ctx: StepContext) -> list[int]:
    """:func:`tokenizer_eos_ids`, or RuntimeError: telling a truncated response needs the EOS ids."""
    eos = tokenizer_eos_ids(ctx)
    if eos is None:
        raise RuntimeError(
            "telling truncated responses needs the tokenizer's EOS id; the reward manager has none"
        )
    return eos


def truncated_rows(batch: Batch, max_length: int, eos: Sequence[int]) -> torch.Tensor:
    """``[B]`` bool: the response used ``max_length`` tokens and its last token is not an EOS id."""
    mask = batch["response_mask"]
    lengths = mask.sum(-1).long()
    last = batch["responses"].gather(1, (lengths - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1)
    ended = torch.isin(last, torch.tensor(list(eos), dtype=last.dtype, device=last.device))
    return (lengths >= max_length) & ~ended


def overlong_shaping(ctx: StepContext, batch: Batch) -> Batch:
    """Add the soft overlong punishment to ``scores`` (and rebuild ``token_rewards``); record it per row."""
    shaping = ctx.cfg.dapo.overlong_shaping
    lengths = batch["response_mask"].sum(-1)
    penalty = overlong_penalty(
        lengths, ctx.cfg.data.max_response_length, shaping.buffer_len, shaping.penalty_factor
    )
    batch["overlong_penalty"] = penalty
    batch["scores"] = batch["scores"].float() + penalty
    batch["token_rewards"] = token_rewards_from_scores(batch["scores"], batch["response_mask"])
    return batch


def overlong_filtered_update_actor(ctx: StepContext, batch: Batch) -> Batch:
    """The built-in ``update_actor`` with truncated rows masked out of the loss; the batch itself is unchanged."""
    truncated = truncated_rows(batch, ctx.cfg.data.max_response_length, eos_ids(ctx))
    view = batch.select(*batch.keys())
    view["response_mask"] = batch["response_mask"] * (~truncated).to(batch["response_mask"].dtype).unsqueeze(
        -1
    )
    update_actor(ctx, view)
    ctx.metrics["dapo/overlong_filtered_share"] = float(truncated.float().mean())
    return batch
