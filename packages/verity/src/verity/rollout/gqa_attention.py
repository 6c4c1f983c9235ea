"""Grouped-query attention without copying the KV cache, for decoding on CPU.

In a grouped-query model (``num_key_value_heads < num_attention_heads``: Qwen2, Llama 3, …)
each key/value head serves ``G`` query heads. transformers' ``sdpa`` attention hands
``scaled_dot_product_attention`` a grouped key/value only when there is no attention mask;
with one — and a batch of left-padded prompts always has one — it first repeats every
key/value head ``G`` times (``repeat_kv``), a copy of the whole cache so far, in every
layer, at every decode step: ``O(T^2)`` bytes over ``T`` new tokens, the cost the reserved
KV cache (:mod:`verity.rollout.kv_cache`) removed from the cache itself.

On CPU, ``scaled_dot_product_attention(..., enable_gqa=True)`` takes the mask and reads the
grouped heads in place: faster than the repeat, and the output is the same to the bit
(``ci/reports/2026-12-06-docstring-figures.md``). :data:`GQA_SDPA` is that
attention, registered with transformers' ``AttentionInterface`` under its own name; on any
other device, for a model without grouped heads, or for a call it does not cover (a position
bias, a paged cache) it is transformers' ``sdpa`` unchanged, whose CUDA kernels take
``enable_gqa`` only without a mask.

One query token in bf16 or fp16 on a CPU without AMX tiles, the fused kernel is slow, and a
decode step's attention is two float32 matmuls instead (:func:`matmul_decode`), recorded as
:data:`GQA_SDPA_MATMUL_DECODE`.

:func:`grouped_sdpa` switches a model to it for the length of a ``with`` block and back::

    with grouped_sdpa(model):
        model(input_ids, attention_mask=mask, past_key_values=cache, use_cache=True)
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

__all__ = [
    "GQA_SDPA",
    "GQA_SDPA_MATMUL_DECODE",
    "grouped_attention_name",
    "grouped_sdpa",
    "matmul_decode",
    "sdpa_grouped_attention",
]

GQA_SDPA = "verity_sdpa_gqa"  # the attention implementation's registered name
# what a run records when its decode steps take the two matmuls (:func:`matmul_decode`)
GQA_SDPA_MATMUL_DECODE = GQA_SDPA + "+matmul_decode"


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
    one_query_mask = attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1:3] == (1, 1))
    if query.shape[2] == 1 and dropout == 0.0 and matmul_decode(query.dtype) and one_query_mask:
        return _grouped_matmul_decode(query, key, value, attention_mask, scaling), None
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


def matmul_decode(dtype: torch.dtype) -> bool:
    """Whether a single-query (decode) call in ``dtype`` runs :func:`_grouped_matmul_decode`
    instead of the fused kernel: bf16 and fp16 on a CPU without AMX tiles.

    There, the fused CPU kernel's reduced-precision path is slower for one query than the two
    float32 matmuls of :func:`_grouped_matmul_decode`; with AMX tiles it is fast, so it stays
    there (``ci/reports/2026-12-06-docstring-figures.md``). float32 stays on the fused kernel
    everywhere (the matmuls gained nothing at the quickstart's shape) and keeps transformers'
    ``sdpa`` to the bit.
    """
    return dtype in (torch.bfloat16, torch.float16) and not _has_amx_tiles()


@functools.cache
def _has_amx_tiles() -> bool:
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else False


def _grouped_matmul_decode(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
) -> torch.Tensor:
    """One query token's attention over grouped key/value heads as two batched matmuls.

    ``query [B, H, 1, D]``, ``key``/``value`` ``[B, H_kv, k, D]`` (``H = G * H_kv``; query head
    ``h`` reads key/value head ``h // G``), ``attention_mask`` ``[B or 1, 1, 1, k]``, boolean
    (True: attend) or additive, or None. Returns ``[B, 1, H, D]`` in the query's dtype.

    The whole computation runs in float32 (query, keys and values widened: softmax of
    ``(q * scale) · k`` over the keys, times the values) and the output is rounded once to the
    query's dtype, so each output is the exact attention to within that one rounding (and
    float32's error). The query's ``G`` heads of one group share their key/value head as the
    rows of one matmul, so no key or value head is repeated.
    """
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    scale = dim**-0.5 if scaling is None else scaling
    grouped = query.reshape(batch, kv_heads, groups, dim).float() * scale
    scores = torch.matmul(grouped, key.float().transpose(-1, -2))  # [B, H_kv, G, k]
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        else:  # an additive mask
            scores = scores + attention_mask.float()
    output = torch.matmul(torch.softmax(scores, dim=-1), value.float())  # [B, H_kv, G, D]
    return output.to(query.dtype).reshape(batch, 1, heads, dim)


def grouped_attention_name(dtype: torch.dtype) -> str:
    """What a model in ``dtype`` switched by :func:`grouped_sdpa` runs, as a run records it:
    :data:`GQA_SDPA_MATMUL_DECODE` where its decode steps take the two matmuls, else :data:`GQA_SDPA`."""
    return GQA_SDPA_MATMUL_DECODE if matmul_decode(dtype) else GQA_SDPA


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
