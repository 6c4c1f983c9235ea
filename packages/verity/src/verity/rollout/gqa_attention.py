"""Grouped-query attention without copying the KV cache, for decoding on CPU.

In a grouped-query model (``num_key_value_heads < num_attention_heads``: Qwen2, Llama 3, …)
each key/value head serves ``G`` query heads. transformers' ``sdpa`` attention hands
``scaled_dot_product_attention`` a grouped key/value only when there is no attention mask;
with one — and a batch of left-padded prompts always has one — it first repeats every
key/value head ``G`` times (``repeat_kv``), a copy of the whole cache so far, in every
layer, at every decode step: ``O(T^2)`` bytes over ``T`` new tokens, the cost the reserved
KV cache (:mod:`verity.rollout.kv_cache`) removed from the cache itself.

On CPU, ``scaled_dot_product_attention(..., enable_gqa=True)`` takes the mask and reads the
grouped heads in place. Measured on the 2-core CPU VM (one thread, bf16, 128 rows, 8 query
/ 4 key-value heads of 64, 100 cached positions, one query token): 1.24 ms a call against
4.73 ms with the repeat, and the output is the same to the bit. :data:`GQA_SDPA` is that
attention, registered with transformers' ``AttentionInterface`` under its own name; on any
other device, for a model without grouped heads, or for a call it does not cover (a position
bias, a paged cache) it is transformers' ``sdpa`` unchanged, whose CUDA kernels take
``enable_gqa`` only without a mask.

:func:`grouped_sdpa` switches a model to it for the length of a ``with`` block and back::

    with grouped_sdpa(model):
        model(input_ids, attention_mask=mask, past_key_values=cache, use_cache=True)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

__all__ = ["GQA_SDPA", "grouped_sdpa", "sdpa_grouped_attention"]

GQA_SDPA = "verity_sdpa_gqa"  # the attention implementation's registered name


def sdpa_grouped_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query [B, H, q, D]``, ``key``/``value``
    ``[B, H_kv, k, D]``, ``attention_mask`` boolean ``[B, 1, q, k]`` (True: attend) or None.

    Returns ``(output [B, q, H, D], None)``. On CPU with grouped heads: one
    ``scaled_dot_product_attention`` over the grouped key/value (``enable_gqa``); otherwise
    transformers' ``sdpa_attention_forward``.
    """
    groups = getattr(module, "num_key_value_groups", 1)
    covered = kwargs.get("position_bias") is None and kwargs.get("cache") is None
    if query.device.type != "cpu" or groups <= 1 or not covered:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # the causal flag only without a mask and with more than one query (a single query sees every key)
    causal = query.shape[2] > 1 and attention_mask is None and bool(causal)
    if causal and key.shape[2] > query.shape[2]:
        raise ValueError(
            f"grouped attention: a causal call without a mask needs as many keys as queries, "
            f"got {key.shape[2]} keys for {query.shape[2]} queries"
        )
    output = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=causal,
        enable_gqa=True,
    )
    return output.transpose(1, 2).contiguous(), None


def _register() -> None:
    """Register the attention and its mask format (transformers' sdpa masks) under :data:`GQA_SDPA`."""
    if GQA_SDPA not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionInterface.register(GQA_SDPA, sdpa_grouped_attention)
        AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)


def _text_config(config: Any) -> Any:
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if getter is not None else config


def takes_grouped_sdpa(model: PreTrainedModel) -> bool:
    """Whether ``model`` runs transformers' ``sdpa`` attention over grouped key/value heads,
    has no vision tower, and sits on the CPU: where :data:`GQA_SDPA` changes anything."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    text = _text_config(config)
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads is None or kv_heads is None or kv_heads >= heads:
        return False
    if getattr(config, "vision_config", None) is not None:
        return False
    parameter = next(model.parameters(), None)
    return parameter is not None and parameter.device.type == "cpu"


@contextmanager
def grouped_sdpa(model: PreTrainedModel) -> Iterator[bool]:
    """Run ``model`` with :data:`GQA_SDPA` inside the block when :func:`takes_grouped_sdpa`;
    yields whether it switched, and puts ``sdpa`` back on the way out."""
    if not takes_grouped_sdpa(model):
        yield False
        return
    _register()
    model.set_attn_implementation(GQA_SDPA)
    try:
        yield True
    finally:
        model.set_attn_implementation("sdpa")
