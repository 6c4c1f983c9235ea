"""One forward pass per prompt group: the shared prompt computed once, its samples after it.

GRPO-style batches hold each prompt ``n`` times (``rollout.n`` samples per prompt), and
the rows of a group sit next to each other in a micro-batch. The padded layout
(:mod:`verity.engines.logprobs`) runs the prompt through the model once per row; here
each group becomes one sequence::

    [ prompt (columns first .. P-1) | sample 1 window | sample 2 window | ... | sample M window ]

with ``kept`` response columns per sample window (the micro-batch's padding-free
width), the rows' own position ids (so sample ``k``'s tokens keep positions
``p .. p+kept-1`` after a prompt of ``p`` real tokens) and a 4-D attention mask:

- a prompt position attends causally to the prompt's real tokens;
- a position of sample ``k`` attends to every real prompt token and, causally, to the
  real tokens of sample ``k`` only (never to another sample);
- every position attends to itself (padding positions then read finite values that
  nothing uses; a row of the mask is never empty).

Each sample therefore sees exactly the keys it sees in its own padded row, so its
hidden states, logits, log-probabilities and gradients are those of the padded pass up
to float rounding; the logits of position ``P-1`` (the prompt's last token) predict
every sample's first token. The prompt's activations are computed once and shared, so
autograd sums the samples' gradients through them, as the padded pass does.

Cost: ``G x (P - first + M x kept)`` positions instead of ``B x (P - first + kept)``
for ``B`` rows in ``G`` groups of at most ``M``. The layout is used when it saves at
least :data:`MIN_SAVING` of the positions, the model's attention takes a custom 4-D mask
(``sdpa`` or ``eager``) and the rows carry no images; otherwise the caller runs the
padded window.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

MIN_SAVING = 0.10  # use the grouped layout only when it computes at least 10% fewer positions
# attention that applies a custom 4-D mask as given (verity_packed_sdpa: sdpa's, verity.engines.packed_attention)
MASK_IMPLEMENTATIONS = ("sdpa", "eager", "verity_packed_sdpa")


@dataclass(frozen=True)
class PromptGroups:
    """Which rows of a micro-batch share a prompt.

    ``group [B]``: each row's group, ``0 .. G-1``; ``slot [B]``: the row's place in its
    group, ``0 .. M-1``; ``first_row [G]``: a row holding each group's prompt;
    ``members``: ``M``, the largest group.
    """

    group: torch.Tensor
    slot: torch.Tensor
    first_row: torch.Tensor
    members: int

    @property
    def num_groups(self) -> int:
        return int(self.first_row.shape[0])


def find_prompt_groups(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    device: torch.device | None = None,
) -> PromptGroups:
    """Group the rows of ``input_ids [B, P+R]`` whose prompt columns ``0 .. P-1`` are equal.

    Two prompts are equal when their real tokens (``attention_mask`` 1) and padding
    agree column by column. Groups are numbered in order of their first row. The index
    tensors are put on ``device`` (default: ``input_ids``'s) without waiting for it.
    """
    prompt = torch.where(attention_mask[:, :prompt_len].bool(), input_ids[:, :prompt_len], -1)
    _, inverse = torch.unique(prompt, dim=0, return_inverse=True)
    rows = inverse.shape[0]
    # renumber by first appearance, so the grouped sequences follow the rows' order
    order_of_first: dict[int, int] = {}
    group = torch.empty(rows, dtype=torch.long)
    slot = torch.empty(rows, dtype=torch.long)
    counts: list[int] = []
    first_row: list[int] = []
    for row, key in enumerate(inverse.tolist()):
        g = order_of_first.setdefault(key, len(order_of_first))
        if g == len(counts):
            counts.append(0)
            first_row.append(row)
        group[row], slot[row] = g, counts[g]
        counts[g] += 1
    device = input_ids.device if device is None else device
    return PromptGroups(
        group=group.to(device, non_blocking=True),
        slot=slot.to(device, non_blocking=True),
        first_row=torch.tensor(first_row, dtype=torch.long).to(device, non_blocking=True),
        members=max(counts) if counts else 0,
    )


def grouped_positions(groups: PromptGroups, prefix_len: int, kept: int) -> int:
    """Positions the grouped layout computes: ``G x (prefix_len + M x kept)``."""
    return groups.num_groups * (prefix_len + groups.members * kept)


def attention_implementation(model: nn.Module) -> str | None:
    """The attention implementation an HF model was loaded with (``config._attn_implementation``), if known."""
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) if config is not None else None


def should_share_prompts(
    model: nn.Module, micro_batch: Mapping[str, Any], groups: PromptGroups, first: int, kept: int
) -> bool:
    """Whether the grouped layout applies to this micro-batch and saves at least :data:`MIN_SAVING`."""
    if "pixel_values" in micro_batch or attention_implementation(model) not in MASK_IMPLEMENTATIONS:
        return False
    rows, width = micro_batch["input_ids"].shape
    prefix_len = width - micro_batch["responses"].shape[1] - first
    padded = rows * (prefix_len + kept)
    return grouped_positions(groups, prefix_len, kept) <= (1.0 - MIN_SAVING) * padded


def build_grouped_inputs(
    micro_batch: Mapping[str, Any],
    groups: PromptGroups,
    first: int,
    kept: int,
    mask_dtype: torch.dtype | None,
) -> dict[str, torch.Tensor]:
    """The model inputs of the grouped layout: ``input_ids``, ``position_ids`` ``[G, L]`` and the 4-D mask.

    ``L = (P - first) + M x kept``. ``attention_mask`` is ``[G, 1, L, L]``: boolean
    (True: may attend) when ``mask_dtype`` is None, else additive in ``mask_dtype``
    (0 or the dtype's lowest value), as ``eager`` attention expects.
    """
    input_ids = micro_batch["input_ids"]
    attention_mask = micro_batch["attention_mask"]
    position_ids = micro_batch["position_ids"]
    prompt_len = input_ids.shape[1] - micro_batch["responses"].shape[1]
    num_groups, members = groups.num_groups, groups.members
    prefix_len = prompt_len - first
    length = prefix_len + members * kept
    device = input_ids.device

    ids = torch.zeros(num_groups, length, dtype=input_ids.dtype, device=device)
    pos = torch.zeros(num_groups, length, dtype=position_ids.dtype, device=device)
    real = torch.zeros(num_groups, length, dtype=torch.bool, device=device)
    ids[:, :prefix_len] = input_ids[groups.first_row, first:prompt_len]
    pos[:, :prefix_len] = position_ids[groups.first_row, first:prompt_len]
    real[:, :prefix_len] = attention_mask[groups.first_row, first:prompt_len].bool()
    # each row's response window goes to its group's sequence at its slot
    columns = prefix_len + groups.slot[:, None] * kept + torch.arange(kept, device=device)[None, :]
    rows_group = groups.group[:, None].expand_as(columns)
    window = slice(prompt_len, prompt_len + kept)
    ids[rows_group, columns] = input_ids[:, window]
    pos[rows_group, columns] = position_ids[:, window]
    real[rows_group, columns] = attention_mask[:, window].bool()

    # block of each column: -1 for the prompt, k for sample slot k
    block = torch.full((length,), -1, dtype=torch.long, device=device)
    block[prefix_len:] = torch.arange(members, device=device).repeat_interleave(kept)
    index = torch.arange(length, device=device)
    causal = index[None, :] <= index[:, None]  # [query, key]
    same_or_prompt = (block[None, :] == -1) | (block[None, :] == block[:, None])
    allowed = (causal & same_or_prompt)[None] & real[:, None, :]  # [G, query, key]
    allowed = allowed | torch.eye(length, dtype=torch.bool, device=device)[None]
    mask = allowed[:, None]
    if mask_dtype is not None:
        zero = torch.zeros((), dtype=mask_dtype, device=device)
        mask = torch.where(mask, zero, torch.finfo(mask_dtype).min)
    return {"input_ids": ids, "position_ids": pos, "attention_mask": mask}


def grouped_mask_dtype(model: nn.Module) -> torch.dtype | None:
    """The 4-D mask's dtype for ``model``: None (boolean) for ``sdpa``, the weights' float dtype for ``eager``."""
    if attention_implementation(model) != "eager":
        return None
    dtype = next(model.parameters()).dtype
    return dtype if dtype.is_floating_point else torch.float32


def logit_index(groups: PromptGroups, kept: int) -> torch.Tensor:
    """``[B, kept]``: where each row's response token ``j`` is predicted among the kept logits.

    The kept logits are the last ``M x kept + 1`` positions of each grouped sequence: the
    prompt's last token (index 0, predicting every sample's token 0), then the sample
    windows; token ``j >= 1`` of slot ``k`` is predicted at ``1 + k x kept + j - 1``.
    """
    j = torch.arange(kept, device=groups.slot.device)[None, :]
    return torch.where(j == 0, 0, 1 + groups.slot[:, None] * kept + j - 1)


def grouped_response_logits(
    model: nn.Module,
    micro_batch: Mapping[str, Any],
    groups: PromptGroups,
    first: int,
    kept: int,
    *,
    logits_to_keep: bool = True,
) -> torch.Tensor:
    """Logits predicting each row's response tokens ``0 .. kept-1``: ``[B, kept, V]``, one forward per micro-batch.

    The caller has checked :func:`should_share_prompts`. ``logits_to_keep``: the model's
    forward takes ``logits_to_keep`` (the LM head then runs on the needed positions only).
    """
    inputs = build_grouped_inputs(micro_batch, groups, first, kept, grouped_mask_dtype(model))
    keep = groups.members * kept + 1
    extra = {"logits_to_keep": keep} if logits_to_keep else {}
    logits = model(**inputs, use_cache=False, **extra).logits[:, -keep:, :]
    return logits[groups.group[:, None], logit_index(groups, kept)]
