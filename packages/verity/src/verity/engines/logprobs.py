"""Per-token log-probabilities and entropy of response tokens, from a causal LM's logits.

Layout (the verl layout): ``input_ids [B, P+R]`` is a left-padded prompt of length
``P`` followed by a right-padded response ``responses [B, R]``. The logit at position
``t`` predicts the token at ``t + 1``, so the response tokens ``input_ids[:, P:P+R]``
are predicted by the logits at positions ``P-1 .. P+R-2``.

For logits ``z`` over a vocabulary of size ``V`` and sampling temperature ``tau``::

    z' = z / tau
    log p(y) = z'_y - logsumexp(z')
    H        = logsumexp(z') - sum_v softmax(z')_v * z'_v

Padding columns are not computed: :func:`response_logprobs` drops the leading columns
that are padding in every row of the micro-batch (left-padded prompts) and the trailing
columns past its longest response, runs the model on what is left and pads the result
back to ``[B, R]`` with zeros (the padded positions are outside ``response_mask``). Under
causal attention a position sees no later column and masked columns are excluded, so the
kept positions' log-probabilities are unchanged (up to float rounding of the shorter
matmuls) while a micro-batch of short answers costs what its real width costs.

Memory: the functions work in float32 on chunks of at most ``chunk_tokens`` rows
(:mod:`verity.engines.fused_logprobs`), so that the extra memory is bounded by
``chunk_tokens * V * 4`` bytes whatever the batch size; the training pass keeps only the
logits as they are (bf16 under autocast) for its hand-written backward. With a gradient
wanted through the entropy (an entropy bonus) one autograd pass over the whole float32
``[N, V]`` is used, in the same arithmetic.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from verity.data.vision_inputs import (
    has_images,
    mask_vision_tokens,
    per_row_images,
    vision_forward_inputs,
    vision_token_ids,
)
from verity.engines.fused_logprobs import chosen_token_logprobs, rows_log_softmax
from verity.engines.shared_prompt import find_prompt_groups, grouped_response_logits, should_share_prompts

DEFAULT_CHUNK_TOKENS = 4096


def logprobs_and_entropy_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    entropy_grad: bool = True,
    compiled_head: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of ``labels`` and entropy of the tempered distribution.

    Args:
        logits: ``[..., V]`` unnormalised scores (any float dtype; computed in float32).
        labels: ``[...]`` int64 token ids, same leading shape as ``logits``.
        temperature: ``tau > 0``; logits are divided by it.
        compute_entropy: return ``None`` for entropy when False.
        chunk_tokens: rows per chunk (bounds peak memory).
        entropy_grad: with autograd on, whether the entropy needs a gradient (an entropy
            bonus: one autograd pass). False (the default elsewhere in the engines) takes the
            chunked path of :mod:`verity.engines.fused_logprobs`: same values, the log-probs'
            gradient by a hand-written backward, the entropy detached.
        compiled_head: that path as two inductor kernels (:mod:`verity.engines.compiled_head`);
            the entropy-bonus autograd pass is not compiled.

    Returns:
        ``(logprobs [...], entropy [...] or None)``, float32, natural-log units (nats).
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits leading shape {tuple(logits.shape[:-1])} must equal labels shape {tuple(labels.shape)}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be > 0, got {chunk_tokens}")
    lead_shape = labels.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1)
    if torch.is_grad_enabled() and flat_logits.requires_grad and compute_entropy and entropy_grad:
        # an entropy bonus: autograd through the whole [N, V], in the chunked path's arithmetic
        logp = rows_log_softmax(flat_logits, 0, flat_logits.shape[0], temperature)
        logprobs = logp.gather(-1, flat_labels.unsqueeze(-1)).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        return logprobs.reshape(lead_shape), entropy.reshape(lead_shape)
    # the training pass (a hand-written backward, no float32 copy kept) and every no-grad pass
    logprobs, entropy = chosen_token_logprobs(
        flat_logits,
        flat_labels,
        temperature=temperature,
        chunk_tokens=chunk_tokens,
        compute_entropy=compute_entropy,
        compiled=compiled_head,
    )
    return logprobs.reshape(lead_shape), None if entropy is None else entropy.reshape(lead_shape)


_LOGITS_TO_KEEP_SUPPORT: dict[type, bool] = {}


def _accepts_logits_to_keep(model: nn.Module) -> bool:
    """Whether ``model.forward`` takes ``logits_to_keep`` (HF causal LMs since 4.50)."""
    cls = type(model)
    if cls not in _LOGITS_TO_KEEP_SUPPORT:
        try:
            params = inspect.signature(model.forward).parameters
            _LOGITS_TO_KEEP_SUPPORT[cls] = "logits_to_keep" in params
        except (TypeError, ValueError):
            _LOGITS_TO_KEEP_SUPPORT[cls] = False
    return _LOGITS_TO_KEEP_SUPPORT[cls]


def response_logprobs(
    model: nn.Module,
    micro_batch: Mapping[str, Any],
    *,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    trim_padding: bool = True,
    share_prompts: bool = True,
    entropy_grad: bool = True,
    compiled_head: bool = False,
    layout: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``model`` on one micro-batch and score its response tokens.

    Args:
        model: a causal LM returning ``.logits [B, T, V]`` (HF convention).
        micro_batch: ``input_ids [B, P+R]``, ``attention_mask [B, P+R]``,
            ``position_ids [B, P+R]``, ``responses [B, R]`` on the model's device; with images
            also per-row ``pixel_values`` / ``image_grid_thw`` lists (their M-RoPE positions
            replace ``position_ids``, see :mod:`verity.data.vision_inputs`).
        temperature: sampling temperature the responses were drawn with.
        compute_entropy: also return per-token entropy.
        entropy_grad: whether autograd must flow through the entropy (see
            :func:`logprobs_and_entropy_from_logits`); False returns it detached.
        trim_padding: run the model on the padding-free window only
            (:func:`padding_free_window`); response positions that are padding
            (``attention_mask`` 0) read 0, so the values do not depend on how rows
            were grouped into micro-batches.
        share_prompts: with ``trim_padding``, rows sharing a prompt (a GRPO group) run as
            one sequence, the prompt computed once (:mod:`verity.engines.shared_prompt`),
            when that saves positions; the values equal the padded window's up to rounding.
        compiled_head: score through :mod:`verity.engines.compiled_head` (engines with
            compiled layers, in every pass).
        layout: the micro-batch's ``input_ids`` and ``attention_mask`` in host memory
            (:func:`verity.engines.micro_batches.host_layout`): the window and the prompt
            groups are planned from them, so the host does not wait for the device; default:
            the micro-batch's own.

    Returns:
        ``(logprobs [B, R], entropy [B, R] or None)`` float32; autograd flows through
        them when grad mode is on. Padding positions of the response read 0 when
        ``trim_padding``.
    """
    input_ids = micro_batch["input_ids"]
    responses = micro_batch["responses"]
    attention_mask = micro_batch["attention_mask"]
    response_len = responses.shape[1]
    plan = micro_batch if layout is None else layout
    first, kept = (
        padding_free_window(plan["attention_mask"], response_len) if trim_padding else (0, response_len)
    )
    end = input_ids.shape[1] - (response_len - kept)
    grouped = None
    if trim_padding and share_prompts and not has_images(micro_batch):
        groups = find_prompt_groups(
            plan["input_ids"],
            plan["attention_mask"],
            input_ids.shape[1] - response_len,
            device=input_ids.device,
        )
        if should_share_prompts(model, micro_batch, groups, first, kept):
            grouped = grouped_response_logits(
                model, micro_batch, groups, first, kept, logits_to_keep=_accepts_logits_to_keep(model)
            )

    def score(logits: torch.Tensor, trailing: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        mask = attention_mask if trim_padding else None
        head = (temperature, compute_entropy, chunk_tokens, entropy_grad, compiled_head)
        return _score(logits, responses, mask, kept, *head, trailing=trailing)

    if grouped is not None:
        return score(grouped)
    kwargs = {
        "input_ids": input_ids[:, first:end],
        "attention_mask": attention_mask[:, first:end],
        "position_ids": micro_batch["position_ids"][:, first:end],
        "use_cache": False,
    }
    if has_images(micro_batch):
        # Vision-language model: the image patches go in whole (every image token lies in the
        # prompt, inside the window, since the window starts at the first real column) and the
        # M-RoPE positions are computed on the window itself; get_rope_index ignores padding
        # columns, so the kept tokens get the positions they have in the full width.
        pixel_values, grids = per_row_images(micro_batch)
        vision, _ = vision_forward_inputs(
            model, kwargs["input_ids"], kwargs["attention_mask"], pixel_values, grids
        )
        kwargs.update(vision)
    if _accepts_logits_to_keep(model):
        # keep only positions P-1 .. P+kept-1 (the last kept+1), the last one is dropped below
        kwargs["logits_to_keep"] = kept + 1
    # The last kept+1 positions: the kept ones and the one after them, scored with a dummy
    # label and dropped in _score. With logits_to_keep this is the model's whole output, so
    # the loss head reads it in place; slicing the extra position off first would copy the
    # [B, kept, V] logits forward and zero-fill and copy their gradient backward.
    logits = model(**kwargs).logits
    if logits.shape[1] != kept + 1:  # no logits_to_keep: a view of the last kept+1 positions
        logits = logits[:, -(kept + 1) :, :]
    if has_images(micro_batch):
        logits = mask_vision_tokens(logits, vision_token_ids(model))  # as the rollout sampled them
    return score(logits, trailing=1)


def _score(
    logits: torch.Tensor,
    responses: torch.Tensor,
    attention_mask: torch.Tensor | None,
    kept: int,
    temperature: float,
    compute_entropy: bool,
    chunk_tokens: int,
    entropy_grad: bool = True,
    compiled_head: bool = False,
    trailing: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs and entropy ``[B, R]`` from the logits ``[B, kept + trailing, V]`` of the first ``kept`` response tokens.

    The ``trailing`` positions after them are scored against token 0 and dropped. Columns
    past ``kept`` read 0; with ``attention_mask`` (``[B, P+R]``) so do padding positions.
    """
    response_len = responses.shape[1]
    labels = responses[:, :kept]
    if trailing:
        labels = F.pad(labels, (0, trailing))
    logprobs, entropy = logprobs_and_entropy_from_logits(
        logits,
        labels,
        temperature=temperature,
        compute_entropy=compute_entropy,
        chunk_tokens=chunk_tokens,
        entropy_grad=entropy_grad,
        compiled_head=compiled_head,
    )
    if trailing:
        logprobs = logprobs[:, :kept]
        entropy = None if entropy is None else entropy[:, :kept]
    if kept < response_len:
        logprobs = F.pad(logprobs, (0, response_len - kept))
        entropy = None if entropy is None else F.pad(entropy, (0, response_len - kept))
    if attention_mask is not None:
        # padding positions read 0 whatever the micro-batch they were computed in
        real = attention_mask[:, -response_len:].to(logprobs.dtype)
        logprobs = logprobs * real
        entropy = None if entropy is None else entropy * real
    return logprobs, entropy


def padding_free_window(attention_mask: torch.Tensor, response_len: int) -> tuple[int, int]:
    """The columns of a micro-batch worth computing: ``(first, kept)``.

    Args:
        attention_mask: ``[B, P+R]``, 1 on real tokens (left-padded prompt, right-padded
            response; tool tokens of a multi-turn response count as real).
        response_len: ``R``.

    Returns:
        ``first``: the first column holding a real token in some row (at most ``P-1``, the
        position predicting the first response token); ``kept``: the response columns up
        to the last one holding a real token in some row (at least 1, at most ``R``).
        Columns ``first .. P+kept-1`` are the padding-free window.
    """
    prompt_len = attention_mask.shape[1] - response_len
    real = attention_mask.bool().any(dim=0)
    prompt_real = torch.nonzero(real[:prompt_len])
    first = min(int(prompt_real[0]) if len(prompt_real) else 0, prompt_len - 1)
    response_real = torch.nonzero(real[prompt_len:])
    kept = int(response_real[-1]) + 1 if len(response_real) else 1
    return first, kept
