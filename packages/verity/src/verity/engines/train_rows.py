"""Training only the rows that carry a gradient: the counts of the whole mini-batch, the passes of some rows.

A GRPO/RLOO group whose samples all got the same score has advantage exactly 0 on every
token; with a policy loss that is a sum of ``A_t x f(ratio_t)`` terms (PPO clip, dual clip,
GSPO, GPG, CISPO) and no KL or entropy term, such a row adds exactly 0 to the loss and to
every gradient. The engines' ``forward_backward(..., train_rows=mask)`` then computes the
mini-batch's normalisers (response tokens, sequences, widest response; the
:class:`~verity.algorithms.aggregation.AggregationContext`) over ALL rows, as without the
mask, and runs forward + backward over the masked rows only: the same gradient, the same
optimizer step, less arithmetic.

A rank whose rows are all masked out still trains its first row (its gradient is exactly
zero), so that every parameter has a gradient (AdamW's moments then advance exactly as
without skipping, and replicated ranks all-reduce the same tensors) and the per-pass
metrics are defined.
"""

from __future__ import annotations

from typing import Any

import torch

from verity.engines.micro_batches import get_tensor, pick_rows


def rows_with_advantage(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: rows with a non-zero advantage on at least one response token.

    Args:
        advantages: ``[B, R]`` per-token advantages.
        response_mask: ``[B, R]``, 1 on real response tokens.
    """
    if advantages.shape != response_mask.shape or advantages.dim() != 2:
        raise ValueError(
            f"advantages {tuple(advantages.shape)} and response_mask {tuple(response_mask.shape)} "
            "must both be [B, R]"
        )
    return ((advantages != 0) & (response_mask > 0)).any(dim=-1)


def trained_row_index(train_rows: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """Indices (``[n]`` int64) of the first ``rows`` rows to run, or ``None`` for all of them.

    ``train_rows`` is a ``[>= rows]`` bool mask (the trailing padding rows of a
    ``Batch.split`` part are never run). When it selects none of the ``rows``, row 0 is
    run (see the module docstring); ``rows == 0`` gives an empty index.
    """
    if train_rows is None:
        return None
    if train_rows.dim() != 1 or train_rows.dtype != torch.bool or train_rows.shape[0] < rows:
        raise ValueError(
            f"train_rows must be a [B] bool mask covering the {rows} rows, got "
            f"{train_rows.dtype} {tuple(train_rows.shape)}"
        )
    index = torch.nonzero(train_rows[:rows].cpu(), as_tuple=False).flatten()
    if index.numel() == 0 and rows > 0:
        index = torch.zeros(1, dtype=torch.long)
    return index


def rows_to_run(batch: Any, rows: int, train_rows: torch.Tensor | None) -> tuple[Any, int, list[float]]:
    """``(batch to run, its row count, [rows skipped, tokens run])`` for ``train_rows`` of the first ``rows``.

    Without a mask: ``batch`` itself and ``rows``. With one: the selected rows as a new
    mini-batch (the caller has computed the whole mini-batch's counts already). "Rows
    skipped" counts the rows the mask left out (the fallback row of an all-masked rank
    included); "tokens run" the attention-mask tokens of the rows that will run.
    """
    index = trained_row_index(train_rows, rows)
    if index is None:
        run, count = batch, rows
    elif index.numel() == 0:  # no real rows here at all (only Batch.split padding)
        run, count = batch, 0
    else:
        run, count = pick_rows(batch, index), int(index.numel())
    skipped = float(rows - int(train_rows[:rows].sum())) if train_rows is not None else 0.0
    tokens = float(get_tensor(run, "attention_mask")[:count].sum()) if count else 0.0
    return run, count, [skipped, tokens]


def step_totals(
    loss: float, response_tokens: float, tokens: float, rows: float, skipped: float, run_tokens: float
) -> dict[str, float]:
    """The totals every train step reports, from values summed over the ranks: ``loss``,
    ``response_tokens``, ``tokens``, ``skipped_row_fraction`` (skipped / rows) and ``trained_tokens``."""
    return {
        "loss": loss,
        "response_tokens": response_tokens,
        "tokens": tokens,
        "skipped_row_fraction": skipped / max(rows, 1.0),
        "trained_tokens": run_tokens,
    }


__all__ = ["rows_to_run", "rows_with_advantage", "step_totals", "trained_row_index"]
