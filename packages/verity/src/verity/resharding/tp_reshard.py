"""Weight sync from FSDP2 shards straight to the slices of a tensor-parallel (TP) rollout.

The training group's ``W`` ranks form ``W / TP`` rollout replicas of ``TP`` consecutive
ranks: rank ``r`` is TP rank ``r % TP`` of replica ``r // TP`` and needs only its TP slice
of every weight (:func:`~verity.resharding.tp_slice.tp_slice_bounds`). Gathering full
tensors and slicing them (:func:`slice_full_buckets`) moves the whole model to every rank;
:func:`iter_tp_slice_buckets` moves about ``1 / TP`` of it.

Per bucket (the same buckets as :func:`~verity.resharding.gather.iter_full_state_dict_buckets`,
planned in full bytes of the output dtype), for the FSDP2 shards (``Shard(0)`` on a 1-D mesh
of more than one rank) of one process group and output dtype:

* every rank knows from the shapes alone which rows each rank holds (``torch.chunk`` over
  ``W``) and which slice each destination ``q`` needs (that of TP rank ``q % TP``): for a
  weight split on dim 0 the rows inside the destination's row range; split on dim ``d >= 1``
  all of the rows, narrowed to the destination's range on ``d``; replicated, all of the rows;
* it packs what goes to each destination into one send buffer (destinations in rank order,
  the bucket's tensors in order, each piece flattened and cast to the output dtype) and
  issues **one** ``all_to_all_single`` with those split sizes;
* a tensor's slice is the flat concatenation of its pieces in source-rank order (the
  sources hold increasing rows, and a row-major slice is its rows one after another).

Everything else (plain tensors, ``Replicate``, other placements, a 1-rank mesh) is taken
whole (``full_tensor()``) and narrowed locally. ``all_to_all_single`` works on gloo (CPU,
torch 2.13: uneven splits, float32/bfloat16/int64) and NCCL; no split is left empty (one
spare element each), since empty ones corrupted gloo's heap under load.

Memory: while a bucket is exchanged, a send and a receive buffer of about ``bucket / TP``
each (a replicated weight counts whole); then the receive buffer and the slices cut from it.
The consumer should drop each
bucket's slices before asking for the next.

Collective: every rank of the group must consume every bucket, in the same order.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from verity.resharding.gather import (
    DEFAULT_BUCKET_BYTES,
    _full_bytes,
    _rows_per_rank,
    _shard_dim0_group,
    _to_full,
    named_weights,
    plan_buckets,
)
from verity.resharding.tp_slice import tp_slice_bounds

__all__ = ["iter_tp_slice_buckets", "slice_full_buckets"]

Bounds = tuple[int, int, int] | None


def _rank_and_world(weights: list[tuple[str, torch.Tensor]]) -> tuple[int, int]:
    """This rank and the group size: from the first DTensor's 1-D mesh, else the default group, else (0, 1)."""
    import torch.distributed as dist

    for _, tensor in weights:
        mesh = getattr(tensor, "device_mesh", None)
        if mesh is not None and mesh.ndim == 1:
            group = mesh.get_group()
            return dist.get_rank(group), dist.get_world_size(group)
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _narrow(tensor: torch.Tensor, bounds: Bounds) -> torch.Tensor:
    """A contiguous copy of ``tensor`` narrowed to ``bounds`` (not a view: the full tensor can be freed); itself when replicated."""
    if bounds is None:
        return tensor
    return tensor.narrow(*bounds).clone(memory_format=torch.contiguous_format)


def _piece(bounds: Bounds, row_start: int, rows: int) -> tuple[int, int, Bounds]:
    """Which part of the rows ``[row_start, row_start + rows)`` a destination whose slice is ``bounds`` needs.

    Returns ``(first local row, row count, narrowing of the remaining dims or None)``.
    """
    if bounds is None:
        return 0, rows, None
    dim, start, length = bounds
    if dim == 0:
        lo, hi = max(row_start, start), min(row_start + rows, start + length)
        return lo - row_start, max(0, hi - lo), None
    return 0, rows, bounds


def _piece_shape(rows: int, rest: tuple[int, ...], narrow: Bounds) -> tuple[int, ...]:
    shape = [rows, *rest]
    if narrow is not None:
        shape[narrow[0]] = narrow[2]
    return tuple(shape)


@torch.no_grad()
def _exchange_dim0_shards(
    members: list[tuple[str, torch.Tensor]],
    group: Any,
    dtype: torch.dtype,
    tp_size: int,
    stats: dict[str, int] | None,
) -> list[torch.Tensor]:
    """This rank's TP slices of same-group FSDP2 dim-0 shards, with one ``all_to_all_single``."""
    import torch.distributed as dist

    world, me = dist.get_world_size(group), dist.get_rank(group)
    if world % tp_size != 0:
        raise ValueError(f"tp_size={tp_size} must divide the group's {world} ranks")
    layouts = []  # per tensor: local shard, rows per rank, row starts, rest, bounds per TP rank
    for name, tensor in members:
        rows, rest = tensor.shape[0], tuple(tensor.shape[1:])
        per_rank = _rows_per_rank(rows, world)
        local = tensor.to_local()
        if tuple(local.shape) != (per_rank[me], *rest):
            raise RuntimeError(
                f"TP reshard: {name}'s local shape {tuple(local.shape)} is not the torch.chunk "
                f"layout expected of FSDP2 ({(per_rank[me], *rest)})"
            )
        starts = [sum(per_rank[:r]) for r in range(world)]
        bounds = [tp_slice_bounds(name, tuple(tensor.shape), t, tp_size) for t in range(tp_size)]
        layouts.append((local, per_rank, starts, rest, bounds))

    def numel(source: int, dest: int, layout) -> int:
        _, per_rank, starts, rest, bounds = layout
        _, n, narrow = _piece(bounds[dest % tp_size], starts[source], per_rank[source])
        return math.prod(_piece_shape(n, rest, narrow))

    # One spare element per source/destination pair: gloo's all_to_all with empty splits (an
    # uneven model, whose slice misses some rank's shard) corrupted the heap under load.
    in_splits = [sum(numel(me, q, lay) for lay in layouts) + 1 for q in range(world)]
    out_splits = [sum(numel(s, me, lay) for lay in layouts) + 1 for s in range(world)]
    device = layouts[0][0].device
    send = torch.zeros(sum(in_splits), dtype=dtype, device=device)
    pos = 0
    for q in range(world):
        for local, per_rank, starts, rest, bounds in layouts:
            first, n, narrow = _piece(bounds[q % tp_size], starts[me], per_rank[me])
            shape = _piece_shape(n, rest, narrow)
            size = math.prod(shape)
            if size:
                part = local.narrow(0, first, n)
                if narrow is not None:
                    part = part.narrow(narrow[0], narrow[1], narrow[2])
                send[pos : pos + size].view(shape).copy_(part)
            pos += size
        pos += 1  # the spare element
    received = torch.empty(sum(out_splits), dtype=dtype, device=device)
    if any(t.numel() for _, t in members):  # the same answer on every rank: shapes are global
        dist.all_to_all_single(received, send, out_splits, in_splits, group=group)
    del send
    if stats is not None:
        stats["received_bytes"] += received.numel() * received.element_size()

    # received: per source in rank order, the members' pieces in order; a slice = its pieces in source order
    offsets, pos = [[0] * world for _ in layouts], 0
    for s in range(world):
        for i, layout in enumerate(layouts):
            offsets[i][s] = pos
            pos += numel(s, me, layout)
        pos += 1  # the spare element
    out = []
    for i, (_, tensor) in enumerate(members):
        bounds = layouts[i][4][me % tp_size]
        shape = list(tensor.shape)
        if bounds is not None:
            shape[bounds[0]] = bounds[2]
        spans = [(offsets[i][s], numel(s, me, layouts[i])) for s in range(world)]
        out.append(torch.cat([received[a : a + n] for a, n in spans]).view(shape))
    return out


def iter_tp_slice_buckets(
    module: nn.Module,
    tp_size: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    stats: dict[str, int] | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield this rank's TP slices of the module's weights, one bucket of ``(name, slice)`` at a time.

    Rank ``r`` of the training group (the FSDP2 mesh's group, else the default group) is TP
    rank ``r % tp_size``; its slice of weight ``name`` with full shape ``S`` is ``S`` narrowed by
    :func:`~verity.resharding.tp_slice.tp_slice_bounds` (the full tensor when replicated). The
    names, their order and the buckets are those of
    :func:`~verity.resharding.gather.iter_full_state_dict_buckets` (tied weights once).

    Args:
        module: a plain or FSDP2-sharded module.
        tp_size: ranks per rollout replica; must divide the group's size.
        bucket_bytes: bucket capacity in FULL bytes of the output dtype (as the full gather).
        dtype: cast floating-point tensors to this dtype (e.g. bfloat16 for the rollout).
        device: move the slices here (default: where the shards live).
        stats: if given, ``"received_bytes"`` (the ``all_to_all`` output bytes, this rank's
            own piece included, plus the FULL bytes of each tensor gathered with
            ``full_tensor()`` over a mesh of more than one rank) and ``"sliced_bytes"`` (bytes
            of the yielded slices) are added to it.

    Collectives: one ``all_to_all_single`` per bucket, process group and output dtype over the
    FSDP2 shards, plus a ``full_tensor()`` per other sharded DTensor; every rank of the group
    must consume every bucket.
    """
    target_device = torch.device(device) if device is not None else None
    weights = named_weights(module)
    rank, world = _rank_and_world(weights)
    if tp_size <= 0 or world % tp_size != 0:
        raise ValueError(f"tp_size={tp_size} must divide the training group's {world} ranks")
    tp_rank = rank % tp_size
    if stats is not None:
        stats.setdefault("received_bytes", 0)
        stats.setdefault("sliced_bytes", 0)
    by_name = dict(weights)
    plan = plan_buckets([(n, _full_bytes(t, dtype)) for n, t in weights], bucket_bytes)
    for names in plan:
        bucket = _slice_bucket(
            [(n, by_name[n]) for n in names], tp_rank, tp_size, dtype, target_device, stats
        )
        if stats is not None:
            sliced = sum(t.numel() * t.element_size() for _, t in bucket)
            stats["sliced_bytes"] += sliced
        yield bucket
        del bucket


def _slice_bucket(
    named: list[tuple[str, torch.Tensor]],
    tp_rank: int,
    tp_size: int,
    dtype: torch.dtype | None,
    device: torch.device | None,
    stats: dict[str, int] | None,
) -> list[tuple[str, torch.Tensor]]:
    """One bucket's slices, in order: FSDP2 shards exchanged per (group, dtype), the rest sliced locally."""
    from torch.distributed.tensor import DTensor, Replicate

    sliced: dict[str, torch.Tensor] = {}
    exchange: dict[tuple[Any, torch.dtype], list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in named:
        group = _shard_dim0_group(tensor)
        if group is not None:
            out_dtype = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
            exchange.setdefault((group, out_dtype), []).append((name, tensor))
            continue
        if (
            stats is not None
            and isinstance(tensor, DTensor)
            and tensor.device_mesh.size() > 1
            and any(not isinstance(p, Replicate) for p in tensor.placements)
        ):
            stats["received_bytes"] += _full_bytes(tensor, None)
        full = _to_full(tensor, dtype, device)
        bounds = tp_slice_bounds(name, tuple(full.shape), tp_rank, tp_size)
        sliced[name] = _narrow(full, bounds)
        del full
    # visited in the bucket's order on every rank (dicts keep insertion order)
    for (group, out_dtype), members in exchange.items():
        for (name, _), part in zip(
            members, _exchange_dim0_shards(members, group, out_dtype, tp_size, stats), strict=True
        ):
            sliced[name] = part.to(device) if device is not None else part
    return [(name, sliced[name]) for name, _ in named]


def slice_full_buckets(
    buckets: Iterable[list[tuple[str, torch.Tensor]]], tp_rank: int, tp_size: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Slice a stream of full-tensor buckets (an engine's ``iter_full_weights``) for TP rank ``tp_rank``.

    The fallback for engines whose weights only come whole (LoRA merge, Megatron): every rank
    receives the full model and keeps its slice. Each split weight becomes a contiguous copy
    of its :func:`~verity.resharding.tp_slice.tp_slice_bounds` slice; a replicated one (or any
    with ``tp_size == 1``) is passed on as it is. Each incoming bucket list is emptied once
    sliced, so that its full tensors can be freed while the slices are consumed.

    Yields:
        lists of ``(name, slice)``, one per incoming bucket, names and order unchanged.
    """
    if tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"need 0 <= tp_rank < tp_size, got tp_rank={tp_rank}, tp_size={tp_size}")
    for bucket in buckets:
        out = [
            (name, _narrow(full, tp_slice_bounds(name, tuple(full.shape), tp_rank, tp_size)))
            for name, full in bucket
        ]
        bucket.clear()
        yield out
        del out
