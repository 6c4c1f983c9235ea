"""Per-token values of response tokens, from a model with a scalar head (a critic).

Layout (the verl layout): ``input_ids [B, P+R]`` is a left-padded prompt of length
``P`` followed by a right-padded response ``responses [B, R]``. A value model maps
every position ``t`` to a scalar ``v_t`` computed from the hidden state there, which
has seen the tokens ``0..t``. The value of response token ``j`` (``0 <= j < R``) is
the value of the state *before* that token is emitted, so it is read at position
``P-1+j``: the response values are ``v[:, P-1 : P+R-1]`` (positions ``P-1 .. P+R-2``),
the same positions whose logits predict the response tokens.

A value model here is any module whose forward takes ``input_ids``,
``attention_mask``, ``position_ids`` and returns an object with ``.logits`` of shape
``[B, T, 1]`` (e.g. an HF ``*ForTokenClassification`` with ``num_labels=1``) or a
tensor ``[B, T]`` / ``[B, T, 1]``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from verity.engines.logprobs import padding_free_window
from verity.engines.shared_prompt import (
    build_grouped_inputs,
    find_prompt_groups,
    grouped_mask_dtype,
    logit_index,
    should_share_prompts,
)


def position_values(module: nn.Module, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Scalar value at every position: ``[B, T]`` (the model's dtype, with autograd if enabled).

    Args:
        module: a value model (see the module docstring).
        inputs: ``input_ids``, ``attention_mask``, ``position_ids``, each ``[B, T]``.
    """
    out = module(
        input_ids=inputs["input_ids"],
        attention_mask=inputs["attention_mask"],
        position_ids=inputs["position_ids"],
    )
    values = getattr(out, "logits", out)
    if not isinstance(values, torch.Tensor):
        raise TypeError(
            f"value model must return a tensor or an output with .logits, got {type(out).__name__}"
        )
    if values.dim() == 3 and values.shape[-1] == 1:
        values = values.squeeze(-1)
    if values.shape != inputs["input_ids"].shape:
        raise ValueError(
            f"value model output must be [B, T] or [B, T, 1] for input_ids {tuple(inputs['input_ids'].shape)}, "
            f"got {tuple(values.shape)} (a critic needs a scalar head, e.g. num_labels=1)"
        )
    return values


def response_values(
    module: nn.Module,
    inputs: Mapping[str, torch.Tensor],
    *,
    trim_padding: bool = True,
    share_prompts: bool = True,
) -> torch.Tensor:
    """Values of the response tokens, ``[B, R]`` float32: positions ``P-1 .. P+R-2`` of :func:`position_values`.

    Args:
        module: a value model.
        inputs: ``input_ids``, ``attention_mask``, ``position_ids`` ``[B, P+R]`` and
            ``responses [B, R]`` (only its width ``R`` is used).
        trim_padding: run the model on the micro-batch's padding-free window only
            (:func:`verity.engines.logprobs.padding_free_window`); response padding
            positions (``attention_mask`` 0) then read 0.
        share_prompts: with ``trim_padding``, rows sharing a prompt run as one sequence with
            the prompt computed once (:mod:`verity.engines.shared_prompt`) when that saves
            positions; the values equal the padded window's up to rounding.
    """
    response_len = inputs["responses"].shape[1]
    attention_mask = inputs["attention_mask"]
    if "pixel_values" in inputs:
        raise ValueError(
            "critic values: the batch carries images but the value model does not take them yet "
            "(docs/multimodal.md); use a critic-free estimator such as GRPO"
        )
    total = inputs["input_ids"].shape[1]
    if not trim_padding:
        values = position_values(module, inputs)
        return values[:, total - response_len - 1 : total - 1].float()
    first, kept = padding_free_window(attention_mask, response_len)
    if share_prompts:
        groups = find_prompt_groups(inputs["input_ids"], attention_mask, total - response_len)
        if should_share_prompts(module, inputs, groups, first, kept):
            grouped = build_grouped_inputs(inputs, groups, first, kept, grouped_mask_dtype(module))
            keep = groups.members * kept + 1
            values = position_values(module, grouped)[:, -keep:].float()
            values = values[groups.group[:, None], logit_index(groups, kept)]
            if kept < response_len:
                values = F.pad(values, (0, response_len - kept))
            return values * attention_mask[:, -response_len:].to(values.dtype)
    end = total - (response_len - kept)
    window = {key: inputs[key][:, first:end] for key in ("input_ids", "attention_mask", "position_ids")}
    values = position_values(module, window)[:, -(kept + 1) : -1].float()
    if kept < response_len:
        values = F.pad(values, (0, response_len - kept))
    return values * attention_mask[:, -response_len:].to(values.dtype)
