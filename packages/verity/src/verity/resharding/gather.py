"""Gather full weights from a (possibly FSDP2-sharded) module, bucket by bucket.

FSDP2 keeps each parameter as a ``DTensor`` sharded on dim 0 across the data-parallel
ranks. A rollout engine needs full tensors. Gathering the whole model at once would
need a full extra copy of the weights; instead the weights are split into buckets of
at most ``bucket_bytes`` (measured in the output dtype) and only one bucket of full
tensors exists at a time:

    for each bucket: full_tensor() each of its parameters -> yield them -> drop them

Peak extra memory is therefore about ``bucket_bytes`` (or one tensor, when a single
tensor is larger than the bucket), provided the consumer copies each tensor and does
not keep references to it.

Gathering is a collective: every rank of the group must iterate the generator to the
end, in the same order (the order is the module's deterministic parameter order).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

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
        bucket = [(name, _to_full(by_name[name], dtype, target_device)) for name in names]
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
