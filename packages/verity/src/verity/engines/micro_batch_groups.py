"""Micro-batches by tokens: which rows of a mini-batch run in one forward pass.

Without a token budget (``fsdp2.micro_batch_tokens=0``) a micro-batch is ``micro_batch_size``
consecutive rows. With one, rows are taken longest first and a micro-batch closes before its
cost would pass the budget (:func:`verity.batch.balance.pack_micro_batches`): long rows get
micro-batches of few rows, short rows share one, so every pass holds about the same positions.
The rows of one prompt (a GRPO group) are taken together, so a micro-batch holding them can
compute the prompt once (:mod:`verity.engines.shared_prompt`) where the budget allows.

The cost of a micro-batch is ``"window"``: its rows x the width of their common padding-free
window (the columns :func:`verity.engines.logprobs.padding_free_window` keeps: what the padded
layout computes), or ``"tokens"``: the sum of its rows' real tokens (what a packed, padding-free
layout computes).

Rows are then no longer consecutive: a micro-batch is an ``[n]`` int64 index of rows. The training
pass sums its micro-batch losses (order does not matter); a no-grad pass puts its answers back in
the rows' order with :func:`restore_index`.
"""

from __future__ import annotations

from typing import Any

import torch

from verity.batch.balance import MicroBatchCost, pack_micro_batches
from verity.engines.micro_batches import get_tensor, pick_rows

__all__ = ["host_rows", "micro_batch_groups", "restore_index", "row_spans", "take_group"]


def row_spans(attention_mask: torch.Tensor, response_len: int) -> torch.Tensor:
    """``[B, 2]`` each row's padding-free window ``(first, end)``: its first real prompt column (at most
    ``P-1``) and one past its last real response column (at least ``P+1``)."""
    prompt_len = attention_mask.shape[1] - response_len
    real = attention_mask.bool()
    columns = torch.arange(attention_mask.shape[1])
    first = torch.where(real[:, :prompt_len], columns[:prompt_len], prompt_len - 1).min(dim=1).values
    last = torch.where(real[:, prompt_len:], columns[prompt_len:] + 1, prompt_len + 1).max(dim=1).values
    return torch.stack([first, last], dim=1)


def prompt_group_ids(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """``[B]`` the same id for rows whose prompts (real tokens and padding, column by column) are equal."""
    prompt = torch.where(attention_mask[:, :prompt_len].bool(), input_ids[:, :prompt_len], -1)
    return torch.unique(prompt, dim=0, return_inverse=True)[1]


def micro_batch_groups(
    batch: Any,
    rows: int,
    micro_batch_size: int,
    max_tokens: int = 0,
    cost: MicroBatchCost = "window",
) -> list[torch.Tensor]:
    """The micro-batches of the first ``rows`` rows of ``batch``: ``[n]`` int64 row indices each.

    Args:
        batch: a mini-batch with ``input_ids``, ``attention_mask`` ``[B, P+R]`` and ``responses`` ``[B, R]``.
        rows: how many leading rows to cover (the rest is ``Batch.split`` padding).
        micro_batch_size: most rows per micro-batch, >= 1.
        max_tokens: most cost per micro-batch (see the module docstring); 0: consecutive rows only.
        cost: ``"window"`` (the padded layout) | ``"tokens"`` (a packed layout).

    Returns:
        every row of ``range(rows)`` in exactly one micro-batch; with ``max_tokens == 0`` the
        consecutive runs ``[0, s), [s, 2s), ...`` of ``s = micro_batch_size`` rows.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if max_tokens < 0:
        raise ValueError(f"micro_batch_tokens must be >= 0 (0: rows only), got {max_tokens}")
    if max_tokens == 0:
        return [torch.arange(s, min(s + micro_batch_size, rows)) for s in range(0, rows, micro_batch_size)]
    mask = get_tensor(batch, "attention_mask")[:rows].cpu()
    response_len = int(get_tensor(batch, "responses").shape[1])
    spans = row_spans(mask, response_len)
    groups = prompt_group_ids(get_tensor(batch, "input_ids")[:rows].cpu(), mask, mask.shape[1] - response_len)
    packed = pack_micro_batches(
        mask.sum(-1), max_tokens, micro_batch_size, spans=spans, groups=groups, cost=cost
    )
    return [torch.tensor(group, dtype=torch.long) for group in packed]


def _as_slice(index: torch.Tensor) -> slice | None:
    """``index`` as a slice when it is a run of consecutive rows (views instead of copies)."""
    if index.numel() == 0:
        return None
    start = int(index[0])
    if torch.equal(index, torch.arange(start, start + index.numel())):
        return slice(start, start + index.numel())
    return None


def take_group(batch: Any, index: torch.Tensor, device: torch.device) -> Any:
    """The rows ``index`` of ``batch`` on ``device`` (a slice's views when they are consecutive)."""
    run = _as_slice(index)
    return pick_rows(batch, run if run is not None else index, device)


def host_rows(batch: Any, index: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """``input_ids`` and ``attention_mask`` of the rows ``index`` when they are in host memory, else None
    (:func:`verity.engines.micro_batches.host_layout` for an index)."""
    ids, mask = get_tensor(batch, "input_ids"), get_tensor(batch, "attention_mask")
    if ids.device.type != "cpu" or mask.device.type != "cpu":
        return None
    run = _as_slice(index)
    rows = run if run is not None else index
    return {"input_ids": ids[rows], "attention_mask": mask[rows]}


def restore_index(groups: list[torch.Tensor]) -> torch.Tensor | None:
    """The index that puts the micro-batches' answers, concatenated, back in row order; None when
    they already are (consecutive micro-batches)."""
    if not groups:
        return None
    order = torch.cat(groups)
    if torch.equal(order, torch.arange(order.numel())):
        return None
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return inverse
