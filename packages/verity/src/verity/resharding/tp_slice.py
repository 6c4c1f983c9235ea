"""Slicing full weights for a rollout engine with tensor parallelism (TP).

Used by TP rollout engines (vLLM/SGLang-style adapters with ``tensor_parallel_size >
1``) that load one shard per TP rank from the full tensors the trainer gathers. The
layout follows Megatron-style parallel linear layers (``y = x W^T``, weight
``[out, in]``) for Qwen2/Llama decoder layers:

==========================================  ==========  =====================================
weight                                      split dim   why
==========================================  ==========  =====================================
``q_proj``, ``k_proj``, ``v_proj`` (W, b)   0           column-parallel: heads split over ranks
``gate_proj``, ``up_proj`` (W)              0           column-parallel: MLP width split
``o_proj``, ``down_proj`` (W)               1           row-parallel: input features split
``o_proj``/``down_proj`` bias               --          replicated (added after the all-reduce)
``embed_tokens``, ``lm_head``               0           vocabulary-parallel
norms and everything else                   --          replicated
==========================================  ==========  =====================================

:func:`tp_slice_bounds` gives where a rank's slice lies under ``torch.chunk`` (what a ``DTensor``
placed ``Shard(dim)`` holds; uneven sizes allowed); :func:`slice_for_tp` cuts it from a full
tensor and requires the split size to divide by ``tp_size``.

Grouped-query attention with fewer key/value heads than TP ranks: each k/v head is
replicated on ``tp_size / num_kv_heads`` consecutive ranks, so rank ``r`` gets head
``r // (tp_size / num_kv_heads)``.
"""

from __future__ import annotations

import torch

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
ROW_PARALLEL = ("o_proj", "down_proj")
KV_PROJECTIONS = ("k_proj", "v_proj")


def _module_and_leaf(name: str) -> tuple[str, str]:
    parts = name.split(".")
    if len(parts) < 2:
        return "", parts[-1]
    return parts[-2], parts[-1]


def tp_split_dim(name: str) -> int | None:
    """The dimension along which weight ``name`` is split for TP, or ``None`` if replicated."""
    module, leaf = _module_and_leaf(name)
    if module in COLUMN_PARALLEL:
        return 0
    if module in ROW_PARALLEL and leaf == "weight":
        return 1
    return None


def tp_slice_bounds(
    name: str, full_shape: tuple[int, ...] | torch.Size, tp_rank: int, tp_size: int
) -> tuple[int, int, int] | None:
    """Where TP rank ``tp_rank`` of ``tp_size`` finds its slice of weight ``name`` of shape ``full_shape``.

    The slice follows ``torch.chunk`` along the split dim (what a ``DTensor`` placed
    ``Shard(dim)`` over ``tp_size`` ranks holds): chunks of ``c = ceil(size / tp_size)``;
    the last ranks may get fewer, or none (``length == 0``, ``start == size``). For sizes
    divisible by ``tp_size`` this is the even split :func:`slice_for_tp` takes.

    Returns:
        ``(dim, start, length)`` in elements along ``dim``, or ``None`` when the weight is
        replicated (see :func:`tp_split_dim`) or ``tp_size == 1``.

    Raises:
        ValueError: a bad ``tp_rank``/``tp_size``, or a split dim the shape does not have.
    """
    if tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"need 0 <= tp_rank < tp_size, got tp_rank={tp_rank}, tp_size={tp_size}")
    dim = tp_split_dim(name)
    if dim is None or tp_size == 1:
        return None
    if dim >= len(full_shape):
        raise ValueError(f"{name}: cannot split dim {dim} of a tensor of shape {tuple(full_shape)}")
    size = full_shape[dim]
    chunk = -(-size // tp_size)
    start = min(tp_rank * chunk, size)
    return dim, start, max(0, min(chunk, size - start))


def slice_for_tp(
    name: str,
    tensor: torch.Tensor,
    tp_rank: int,
    tp_size: int,
    *,
    num_kv_heads: int | None = None,
) -> torch.Tensor:
    """The part of full weight ``tensor`` that TP rank ``tp_rank`` of ``tp_size`` holds.

    Args:
        name: the weight's name (``model.layers.0.self_attn.q_proj.weight`` ...).
        tensor: the full tensor (``[out, in]`` for weights, ``[out]`` for biases).
        tp_rank: rank in ``[0, tp_size)``.
        tp_size: number of TP ranks.
        num_kv_heads: key/value heads of the model; needed only when it is smaller
            than ``tp_size`` (k/v heads are then replicated, see the module docstring).

    Returns:
        a contiguous tensor: ``size(dim) / tp_size`` rows/columns along the split dim,
        or ``tensor`` itself when the weight is replicated or ``tp_size == 1``.
    """
    if tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"need 0 <= tp_rank < tp_size, got tp_rank={tp_rank}, tp_size={tp_size}")
    dim = tp_split_dim(name)
    if dim is None or tp_size == 1:
        return tensor
    if dim >= tensor.dim():
        raise ValueError(f"{name}: cannot split dim {dim} of a tensor of shape {tuple(tensor.shape)}")
    module, _ = _module_and_leaf(name)
    if module in KV_PROJECTIONS and num_kv_heads is not None and num_kv_heads < tp_size:
        if tp_size % num_kv_heads != 0:
            raise ValueError(
                f"{name}: tp_size={tp_size} must be a multiple of num_kv_heads={num_kv_heads} to replicate k/v heads"
            )
        if tensor.shape[0] % num_kv_heads != 0:
            raise ValueError(
                f"{name}: size {tensor.shape[0]} is not divisible by num_kv_heads={num_kv_heads}"
            )
        head_dim = tensor.shape[0] // num_kv_heads
        head = tp_rank // (tp_size // num_kv_heads)
        return tensor.narrow(0, head * head_dim, head_dim).contiguous()
    size = tensor.shape[dim]
    if size % tp_size != 0:
        raise ValueError(f"{name}: size {size} along dim {dim} is not divisible by tp_size={tp_size}")
    bounds = tp_slice_bounds(name, tuple(tensor.shape), tp_rank, tp_size)
    assert bounds is not None
    _, start, length = bounds
    return tensor.narrow(dim, start, length).contiguous()
