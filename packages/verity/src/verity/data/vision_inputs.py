"""Forward-pass inputs of a vision-language model (Qwen2-VL / Qwen2.5-VL) for a batch of rows.

A batch with images carries, per row, ``pixel_values [patches_i, D]`` and ``image_grid_thw
[images_i, 3]`` (see :mod:`verity.data.multimodal`). The model takes them concatenated over
the rows, in row order (the order its image tokens appear in ``input_ids``), and takes
3-D M-RoPE position ids ``[3, B, T]`` (time, height, width) that the model's own
``get_rope_index`` computes from ``input_ids``, the image grids and ``attention_mask``:
text tokens advance all three by one, an image's tokens take ``(t, h, w)`` grid
coordinates offset by the position where the image starts, and the text after the image
resumes at ``start + max(h, w) / merge``. Padding columns (``attention_mask`` 0) are
ignored, so a window that drops all-padding columns gets the same positions for the
tokens it keeps. The rollout and the trainer both build their inputs here, so they see
the same positions for the same tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

VISION_KEYS = ("pixel_values", "image_grid_thw")
MASKED_LOGIT = -1e4
"""Logit given to tokens a policy must not emit: representable in float16/bfloat16/float32, and
``exp(MASKED_LOGIT - logsumexp)`` is exactly 0 in float32 whenever the largest logit exceeds -9800."""


def has_images(batch: Any) -> bool:
    """Whether ``batch`` (a ``Batch`` or a mapping) carries the per-row image keys."""
    keys = batch.keys() if hasattr(batch, "keys") else ()
    return "pixel_values" in keys and "image_grid_thw" in keys


def _rope_index_owner(model: nn.Module) -> Any:
    for candidate in (model, getattr(model, "model", None)):
        if candidate is not None and callable(getattr(candidate, "get_rope_index", None)):
            return candidate
    raise TypeError(
        f"{type(model).__name__}: the batch has images but the model has no get_rope_index "
        "(a Qwen2-VL / Qwen2.5-VL model is needed)"
    )


def image_token_id_of(model: nn.Module) -> int:
    """The model config's ``image_token_id``."""
    token_id = getattr(model.config, "image_token_id", None)
    if token_id is None:
        raise TypeError(f"{type(model).__name__}: config has no image_token_id")
    return int(token_id)


def vision_token_ids(model: nn.Module) -> list[int]:
    """The ids of the vision special tokens (image/video pads, vision start/end) in the model's config."""
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return sorted({int(v) for n in names if (v := getattr(model.config, n, None)) is not None})


def mask_vision_tokens(logits: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
    """``logits [..., V]`` with the vision tokens set to ``MASKED_LOGIT`` (out of place, autograd-safe).

    A policy that sampled an image pad would put an image slot with no image into its own
    sequence, which the model cannot read back; so with images the policy's distribution
    is the model's renormalised over the other tokens, in the rollout and the trainer alike.
    The fill is finite, not -inf: its probability underflows to exactly 0 all the same, while
    the entropy's ``p * z`` terms stay 0 instead of ``0 * -inf = nan``.
    """
    index = torch.tensor(list(token_ids), dtype=torch.long, device=logits.device)
    return logits.index_fill(-1, index, MASKED_LOGIT)


def vision_forward_inputs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    pixel_values: Sequence[torch.Tensor],
    image_grid_thw: Sequence[torch.Tensor],
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The image keyword arguments of one forward pass, and each row's M-RoPE offset.

    Args:
        model: the vision-language model (possibly FSDP-wrapped; only its config and
            ``get_rope_index`` are used here).
        input_ids, attention_mask: ``[B, T]`` on the compute device.
        pixel_values: per row ``[patches_i, D]``; image_grid_thw: per row ``[images_i, 3]``.

    Returns:
        ``({"position_ids" [3, B, T], "pixel_values" [sum patches, D] or absent,
        "image_grid_thw" [sum images, 3] or absent}, deltas [B, 1])`` where a row's next
        text position is ``its number of real tokens + delta``.
    """
    if len(pixel_values) != input_ids.shape[0] or len(image_grid_thw) != input_ids.shape[0]:
        raise ValueError(
            f"pixel_values / image_grid_thw: expected one entry per row ({input_ids.shape[0]}), "
            f"got {len(pixel_values)} / {len(image_grid_thw)}"
        )
    device = input_ids.device
    grid = torch.cat([g.reshape(-1, 3).long() for g in image_grid_thw]).to(device)
    image_tokens = input_ids == image_token_id_of(model)
    kwargs: dict[str, torch.Tensor] = {}
    if grid.shape[0] == 0:
        # no image in these rows: plain 1-D positions, the same on the three axes
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        kwargs["position_ids"] = positions.unsqueeze(0).expand(3, -1, -1)
        deltas = torch.zeros((input_ids.shape[0], 1), dtype=torch.long, device=device)
        return kwargs, deltas
    owner = _rope_index_owner(model)
    positions, deltas = owner.get_rope_index(
        input_ids,
        mm_token_type_ids=image_tokens.int(),
        image_grid_thw=grid,
        attention_mask=attention_mask,
    )
    rows = [p for p in pixel_values if p.numel()]
    kwargs["pixel_values"] = torch.cat(rows).to(device)
    kwargs["image_grid_thw"] = grid
    kwargs["position_ids"] = positions
    return kwargs, deltas.reshape(-1, 1).to(device)


def per_row_images(batch: Mapping[str, Any] | Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(pixel_values, image_grid_thw)`` lists of a batch that :func:`has_images`."""
    return list(batch["pixel_values"]), list(batch["image_grid_thw"])
