"""Causal attention kept inside each row of a packed sequence (:mod:`verity.engines.packed`).

A packed forward pass runs ``[1, T]`` tokens: the real tokens of ``n`` rows back to back,
row ``i`` at positions ``cu_seqlens[i] .. cu_seqlens[i+1]-1``. Each token must attend,
causally, to the tokens of its own row only. transformers 5 passes ``cu_seq_lens_q``,
``cu_seq_lens_k``, ``max_length_q`` and ``max_length_k`` given to the model's forward on to
the attention function of every layer:

- on CUDA with ``flash-attn`` installed, transformers' ``flash_attention_2`` consumes them
  natively (variable-length flash attention); :func:`packed_kernel` picks it there (not run
  by verity yet: no GPU with flash-attn has been lent);
- elsewhere :data:`PACKED_SDPA` (``verity_packed_sdpa``): transformers' ``sdpa`` for a padded
  call (its masks, its kernel), and for a packed call (``cu_seq_lens_q`` given, no mask)
  PyTorch's SDPA over tiles of the packed sequence: a row at least :data:`TILE_TOKENS` long
  is one causal SDPA call with no mask (the CPU flash kernel: memory linear in its length),
  and consecutive shorter rows are grouped into tiles of at most :data:`TILE_TOKENS` tokens,
  each one SDPA call with a small block-diagonal causal mask ``[tile, tile]``. So memory
  stays ``O(T x tile)``, never ``O(T^2)``, and no key of another row is ever read.

Grouped key/value heads (GQA, fewer KV heads than query heads) are read in place
(``enable_gqa``) on the CPU and repeated on other devices when a mask is given.

An engine switches its model to the packed kernel once (:func:`use_packed_kernel`): padded
passes (images, shared prompts) run as under ``sdpa``, and activation checkpointing's
recomputation sees the same kernel as the forward. :func:`packed_attention` switches a
model for one block instead (a direct call of the packed functions on a plain model).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "FLASH_VARLEN",
    "PACKED_KERNELS",
    "PACKED_SDPA",
    "TILE_TOKENS",
    "attention_tiles",
    "packed_attention",
    "packed_kernel",
    "packed_sdpa_attention",
    "packed_sdpa_mask",
    "register_packed_attention",
    "use_packed_kernel",
]

PACKED_SDPA = "verity_packed_sdpa"
FLASH_VARLEN = ("flash_attention_2", "flash_attention_3")  # transformers' kernels that read cu_seq_lens
PACKED_KERNELS = (PACKED_SDPA, *FLASH_VARLEN)  # kernels that keep a packed pass's rows apart
TILE_TOKENS = 256  # rows shorter than this share tiles of at most this many tokens

# one-entry cache: the tiles of the last cu_seqlens seen (every layer of a pass passes the same tensor)
_LAST_TILES: list[Any] = [None, None]


def attention_tiles(
    cu_seqlens: torch.Tensor | list[int], tile: int = TILE_TOKENS
) -> list[tuple[int, int, torch.Tensor | None]]:
    """How a packed sequence is cut for SDPA: ``[(start, end, mask or None), ...]`` covering ``0 .. T``.

    Args:
        cu_seqlens: ``[n+1]`` row boundaries (``cu[0] = 0``, ``cu[n] = T``); empty rows allowed.
        tile: rows of at least ``tile`` tokens run alone; shorter consecutive rows are grouped
            while the group holds at most ``tile`` tokens.

    Returns:
        Spans in order. ``mask`` is None for a span holding one row (plain causal attention),
        else a ``[L, L]`` bool (True: may attend) that is causal within each row of the span
        and False across rows, on the CPU (moved by the caller).
    """
    bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    spans: list[tuple[int, int, torch.Tensor | None]] = []
    group: list[int] = []  # lengths of the short rows gathered so far
    start = 0

    def close(end: int) -> None:
        if not group:
            return
        if len(group) == 1:
            spans.append((start, end, None))
            return
        segment = torch.repeat_interleave(torch.arange(len(group)), torch.tensor(group))
        index = torch.arange(end - start)
        mask = (segment[:, None] == segment[None, :]) & (index[None, :] <= index[:, None])
        spans.append((start, end, mask))

    position = 0
    for length in lengths:
        if length == 0:
            continue
        if length >= tile or (group and sum(group) + length > tile):
            close(position)
            group, start = [], position
        if length >= tile:
            spans.append((position, position + length, None))
            start = position + length
        else:
            if not group:
                start = position
            group.append(length)
        position += length
    close(position)
    return spans


def _cached_tiles(cu_seqlens: torch.Tensor, tile: int) -> list[tuple[int, int, torch.Tensor | None]]:
    """:func:`attention_tiles` computed once per pass (the same tensor reaches every layer), masks on the device."""
    key, tiles = _LAST_TILES
    if key is not None and key[0] is cu_seqlens and key[1] == tile:
        return tiles
    device = cu_seqlens.device
    tiles = [
        (a, b, None if m is None else m.to(device)) for a, b, m in attention_tiles(cu_seqlens.cpu(), tile)
    ]
    _LAST_TILES[:] = [(cu_seqlens, tile), tiles]
    return tiles


def _repeat_heads(states: torch.Tensor, groups: int) -> torch.Tensor:
    """``[1, KV, L, d] -> [1, KV * groups, L, d]``, each KV head repeated for its query heads."""
    if groups == 1:
        return states
    one, kv, length, dim = states.shape
    return states[:, :, None].expand(one, kv, groups, length, dim).reshape(one, kv * groups, length, dim)


def packed_sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The HF attention function :data:`PACKED_SDPA`: packed calls kept inside each row, others as ``sdpa``.

    Args:
        module: the attention layer.
        query: ``[B, H, T, d]``; key, value: ``[B, KV, T, d]`` with ``H % KV == 0``.
        attention_mask: a padded call's mask (as transformers' ``sdpa`` takes it); a packed
            call has none.
        dropout: attention dropout probability (0 outside training).
        scaling: softmax scale; None: ``d ** -0.5``.
        sliding_window: a sliding-window layer's window; packed rows longer than it are refused.
        kwargs: a packed call's ``cu_seq_lens_q`` ``[n+1]`` int32 and ``max_length_q``; the rest
            goes to ``sdpa`` in a padded call.

    Returns:
        ``(out [B, T, H, d], weights or None)``, as transformers' ``sdpa`` returns it.
    """
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None or attention_mask is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if sliding_window is not None:
            kwargs["sliding_window"] = sliding_window
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if not getattr(module, "is_causal", True):
        raise ValueError(f"attention {PACKED_SDPA!r} packs causal layers only, not {type(module).__name__}")
    longest = kwargs.get("max_length_q")
    if sliding_window is not None and (longest is None or int(longest) > sliding_window):
        raise NotImplementedError(
            f"packed attention with a sliding window ({sliding_window}) and rows up to {longest} tokens"
        )
    return _tiled_attention(query, key, value, cu_seqlens, dropout, scaling)


@torch.compiler.disable  # host-planned tiles: compiled layers call it eagerly (one graph break)
def _tiled_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    dropout: float,
    scaling: float | None,
) -> tuple[torch.Tensor, None]:
    """Causal SDPA within each row of a packed ``[1, H, T, d]`` query; ``(out [1, T, H, d], None)``."""
    if query.shape[0] != 1:
        raise ValueError(f"a packed pass has one sequence, got a query batch of {query.shape[0]}")
    heads, kv_heads = query.shape[1], key.shape[1]
    groups = heads // kv_heads
    on_cpu = query.device.type == "cpu"
    outputs = []
    for start, end, mask in _cached_tiles(cu_seqlens, TILE_TOKENS):
        q, k, v = query[:, :, start:end], key[:, :, start:end], value[:, :, start:end]
        gqa = groups > 1 and (on_cpu or mask is None)
        if groups > 1 and not gqa:
            k, v = _repeat_heads(k, groups), _repeat_heads(v, groups)
        outputs.append(
            F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=dropout,
                is_causal=mask is None,
                scale=scaling,
                enable_gqa=gqa,
            )
        )
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
    return out.transpose(1, 2).contiguous(), None


def packed_sdpa_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """The mask function of :data:`PACKED_SDPA`: ``sdpa``'s for a padded call, none for a call without a mask.

    A packed pass gives no ``attention_mask``; transformers would otherwise build a
    ``[T, T]`` mask from its restarting position ids. The attention function keeps the rows
    apart (``cu_seq_lens_q``), or runs plain causal SDPA when there are none.
    """
    if kwargs.get("attention_mask") is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def register_packed_attention() -> None:
    """Register :data:`PACKED_SDPA` with transformers: its attention and mask functions (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if PACKED_SDPA not in AttentionInterface._global_mapping:
        AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
    if PACKED_SDPA not in AttentionMaskInterface._global_mapping:
        AttentionMaskInterface.register(PACKED_SDPA, packed_sdpa_mask)


def packed_kernel(model: nn.Module, device: torch.device) -> str:
    """The attention kernel a packed pass of ``model`` runs on ``device``.

    The model's own when it is a flash kernel (it reads ``cu_seq_lens`` natively);
    ``flash_attention_2`` on CUDA when ``flash-attn`` is installed; else :data:`PACKED_SDPA`.
    """
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current in PACKED_KERNELS:
        if current == PACKED_SDPA:
            register_packed_attention()
        return current
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    register_packed_attention()
    return PACKED_SDPA


def _configs(model: nn.Module) -> list[Any]:
    """The distinct HF configs of ``model`` and its submodules (each attention layer reads one)."""
    seen: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation_internal"):
            seen.setdefault(id(config), config)
    return list(seen.values())


def use_packed_kernel(model: nn.Module, device: torch.device) -> str:
    """Switch ``model`` for good to the kernel its packed passes need (:func:`packed_kernel`); returns it."""
    kernel = packed_kernel(model, device)
    for config in _configs(model):
        config._attn_implementation_internal = kernel
    return kernel


@contextlib.contextmanager
def packed_attention(model: nn.Module, kernel: str) -> Iterator[None]:
    """Within the block, every attention layer of ``model`` computes with ``kernel``; restored after.

    Sets ``config._attn_implementation_internal`` directly (what ``set_attn_implementation``
    sets after its checks, which :func:`packed_kernel` has made): cheap enough for every pass.
    """
    configs = _configs(model)
    saved = [config._attn_implementation_internal for config in configs]
    try:
        for config in configs:
            config._attn_implementation_internal = kernel
        yield
    finally:
        for config, name in zip(configs, saved, strict=True):
            config._attn_implementation_internal = name
