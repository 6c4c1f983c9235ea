"""Gather full weights from a (possibly FSDP2-sharded) module, bucket by bucket.

FSDP2 keeps each parameter as a ``DTensor`` sharded on dim 0 across the data-parallel
ranks. A rollout engine needs full tensors. Gathering the whole model at once would
need a full extra copy of the weights; instead the weights are split into buckets of
at most ``bucket_bytes`` (measured in the output dtype) and only one bucket of full
tensors exists at a time:

    for each bucket: gather its parameters -> yield them -> drop them

A bucket's FSDP2 shards (``Shard(0)`` on a 1-D mesh, as ``fully_shard`` lays them out)
are gathered with **one** all-gather into a single tensor per dtype: each rank packs its
local rows, padded to the shard size ``ceil(n / W)``, into one flat buffer; the gathered
buffer is cut back into each rank's rows and concatenated. Every other tensor (plain,
replicated, other placements) goes through ``DTensor.full_tensor()`` on its own. A
per-parameter gather costs a collective per tensor — on gloo about a millisecond each,
which for a small model is most of the sync.

Peak extra memory is therefore about ``bucket_bytes`` (or one tensor, when a single
tensor is larger than the bucket), provided the consumer copies each tensor and does
not keep references to it.

Gathering is a collective: every rank of the group must iterate the generator to the
end, in the same order (the order is the module's deterministic parameter order).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024


def plan_buckets(sizes: Sequence[tuple[str, int]], bucket_bytes: int) -> list[list[str]]:
    """Group names into consecutive buckets whose byte sizes sum to at most ``bucket_bytes``.

    Args:
        sizes: ``(name, bytes)`` in gathering order.
        bucket_bytes: capacity of one bucket; a tensor larger than it gets a bucket alone.

    Returns:
        buckets of names, order preserved, no bucket empty.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, nbytes in sizes:
        if nbytes < 0:
            raise ValueError(f"tensor {name!r} has negative size {nbytes}")
        if current and used + nbytes > bucket_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append(name)
        used += nbytes
    if current:
        buckets.append(current)
    return buckets


def named_weights(module: nn.Module, include_tied: bool = False) -> list[tuple[str, torch.Tensor]]:
    """Parameters then persistent buffers of ``module``, in a deterministic order.

    Tied parameters (e.g. ``lm_head.weight`` sharing ``embed_tokens.weight``) appear once,
    under their first name, unless ``include_tied``. Non-persistent buffers (rotary
    tables) are left out: they are not part of a checkpoint.
    """
    out: list[tuple[str, torch.Tensor]] = list(module.named_parameters(remove_duplicate=not include_tied))
    for mod_name, mod in module.named_modules():
        skip = getattr(mod, "_non_persistent_buffers_set", set())
        for buf_name, buf in mod.named_buffers(recurse=False):
            if buf is not None and buf_name not in skip:
                out.append((f"{mod_name}.{buf_name}" if mod_name else buf_name, buf))
    return out


def _full_bytes(tensor: torch.Tensor, dtype: torch.dtype | None) -> int:
    element = torch.empty((), dtype=dtype or tensor.dtype).element_size()
    return tensor.numel() * element  # DTensor.numel() is the global (full) size


@torch.no_grad()
def _to_full(tensor: torch.Tensor, dtype: torch.dtype | None, device: torch.device | None) -> torch.Tensor:
    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach()
    if dtype is not None and full.dtype != dtype and full.is_floating_point():
        full = full.to(dtype)
    if device is not None:
        full = full.to(device)
    return full


def _shard_dim0_group(tensor: torch.Tensor) -> Any | None:
    """The process group of a ``DTensor`` sharded on dim 0 over a 1-D mesh (FSDP2's layout), else None."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(tensor, DTensor) or tensor.device_mesh.ndim != 1 or tensor.dim() == 0:
        return None
    if tensor.device_mesh.size() == 1:
        # one rank holds the full tensor and full_tensor() issues no collective; a gloo
        # all_gather on a 1-rank group slowed the quickstart's later steps
        # (ci/reports/2026-12-06-docstring-figures.md)
        return None
    if tuple(tensor.placements) != (Shard(0),):
        return None
    return tensor.device_mesh.get_group()


def _rows_per_rank(rows: int, world: int) -> list[int]:
    """Rows of dim 0 each rank holds under ``torch.chunk`` sharding (the last ranks may hold fewer, or none)."""
    chunk = -(-rows // world) if rows else 0
    return [max(0, min(chunk, rows - r * chunk)) for r in range(world)]


@torch.no_grad()
def _gather_dim0_shards(
    tensors: list[torch.Tensor], group: Any, dtype: torch.dtype
) -> list[torch.Tensor] | None:
    """Full tensors of same-group dim-0 shards in one collective; None if a local shape is not the expected one."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if len(tensors) == 1:
        return _gather_one_tensor(tensors[0], group, world, rank, dtype)
    locals_, layouts = [], []
    for tensor in tensors:
        rows, rest = tensor.shape[0], tuple(tensor.shape[1:])
        per_rank = _rows_per_rank(rows, world)
        local = tensor.to_local()
        if tuple(local.shape) != (per_rank[rank], *rest):
            return None
        chunk = max(per_rank) if per_rank else 0
        row_numel = math.prod(rest)
        padded = local.new_zeros((chunk * row_numel,), dtype=dtype)
        padded[: local.numel()] = local.reshape(-1).to(dtype)
        locals_.append(padded)
        layouts.append((per_rank, chunk, rest, row_numel))
    # every rank reaches this point with the same shapes, so the collective always matches
    send = torch.cat(locals_) if locals_ else torch.empty(0, dtype=dtype)
    received = send.new_empty((world * send.numel(),))
    # all_gather_single is the name torch >= 2.13 gives all_gather_into_tensor (deprecated there)
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather_single(received, send, group=group)
    per_rank_buffers = received.view(world, -1)
    out, offset = [], 0
    for per_rank, chunk, rest, row_numel in layouts:
        size = chunk * row_numel
        pieces = [
            per_rank_buffers[r, offset : offset + per_rank[r] * row_numel].view(per_rank[r], *rest)
            for r in range(world)
        ]
        out.append(torch.cat(pieces))
        offset += size
    return out


@torch.no_grad()
def _gather_one_tensor(
    tensor: torch.Tensor, group: Any, world: int, rank: int, dtype: torch.dtype
) -> list[torch.Tensor] | None:
    """One tensor alone in its bucket, gathered straight into its full tensor (no staging copies).

    A tensor larger than the bucket (the embedding, ``V x H``) comes alone. Rank r holds rows
    ``r c .. (r + 1) c`` (``c = ceil(rows / W)``, the last ranks fewer), so the collective's
    output buffer of ``W c`` rows, in rank order, starts with the full tensor: its first
    ``rows`` rows are returned as they are (a contiguous view). Holds the full tensor once,
    where the coalesced path holds it about three times.
    """
    import torch.distributed as dist

    rows, rest = tensor.shape[0], tuple(tensor.shape[1:])
    per_rank = _rows_per_rank(rows, world)
    local = tensor.to_local()
    if tuple(local.shape) != (per_rank[rank], *rest):
        return None
    chunk = max(per_rank)
    send = local.to(dtype)
    if send.shape[0] != chunk:  # a short last shard: padded to the common size
        send = torch.cat([send, send.new_zeros((chunk - send.shape[0], *rest))])
    buffer = send.new_empty((world * chunk, *rest))
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather_single(buffer, send.contiguous(), group=group)
    return [buffer[:rows]]


def _gather_bucket(
    named: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None, device: torch.device | None
) -> list[tuple[str, torch.Tensor]]:
    """Full tensors of one bucket, in order: coalesced for FSDP2 shards, ``full_tensor()`` for the rest."""
    full: dict[str, torch.Tensor] = {}
    coalesce: dict[tuple[Any, torch.dtype], list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in named:
        group = _shard_dim0_group(tensor)
        out_dtype = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        if group is None:
            full[name] = _to_full(tensor, dtype, device)
        else:
            coalesce.setdefault((group, out_dtype), []).append((name, tensor))
    # the groups are visited in the bucket's order on every rank (dicts keep insertion order)
    for (group, out_dtype), members in coalesce.items():
        gathered = _gather_dim0_shards([t for _, t in members], group, out_dtype)
        if gathered is None:
            raise RuntimeError(
                "weight gather: a shard's local shape is not the torch.chunk layout expected of FSDP2 "
                f"(parameters {[n for n, _ in members]})"
            )
        for (name, _), tensor in zip(members, gathered, strict=True):
            full[name] = tensor.to(device) if device is not None else tensor
    return [(name, full[name]) for name, _ in named]


def iter_full_state_dict_buckets(
    module: nn.Module,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    include_tied: bool = False,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield the module's full weights one bucket (a list of ``(name, tensor)``) at a time.

    Args:
        module: a plain or FSDP2-sharded module.
        bucket_bytes: bucket capacity in bytes of the output dtype.
        dtype: cast floating-point tensors to this dtype (e.g. bfloat16 for the rollout).
        device: move full tensors here (default: where they were gathered).
        include_tied: also yield tied aliases under their own names.

    Collective on sharded modules: all ranks must consume every bucket.
    """
    target_device = torch.device(device) if device is not None else None
    weights = named_weights(module, include_tied=include_tied)
    by_name = dict(weights)
    plan = plan_buckets([(n, _full_bytes(t, dtype)) for n, t in weights], bucket_bytes)
    for names in plan:
        bucket = _gather_bucket([(name, by_name[name]) for name in names], dtype, target_device)
        yield bucket
        del bucket


def iter_full_state_dict(
    module: nn.Module,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    include_tied: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full tensor)`` for every weight, gathered in buckets.

    Same arguments as :func:`iter_full_state_dict_buckets`; names are the module's own
    (FSDP2 does not change parameter names). Collective on sharded modules.
    """
    for bucket in iter_full_state_dict_buckets(
        module, bucket_bytes, dtype=dtype, device=device, include_tied=include_tied
    ):
        while bucket:
            yield bucket.pop(0)
