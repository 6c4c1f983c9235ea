"""Weight sync: hand the trainer's current weights to a rollout engine.

``sync_weights(engine, rollout)`` streams full tensors gathered bucket by bucket
through an optional name mapper into ``rollout.load_weights(named_tensors)``. The
buckets come from the engine's ``iter_full_weights(bucket_bytes, dtype=, device=)``
(every :class:`~verity.engines.TrainingEngine` has it: FSDP2 gathers its ``DTensor``
shards with :mod:`verity.resharding.gather`; Megatron gathers tensor-parallel shards and
collects pipeline stages, under HF names) or, for a plain module, from
:func:`~verity.resharding.gather.iter_full_state_dict_buckets`.

Colocated (the rollout lives in the same process as the trainer rank, the default
on one machine): the gathered tensors are copied straight into the rollout model's
parameters with ``Tensor.copy_`` (:func:`copy_named_tensors_into`); nothing is
serialised or sent over a socket, and on a GPU the copy stays on the device.

Tensor-parallel rollout (``rollout.tensor_parallel_size > 1``): the training group's ranks
form replicas of ``tp`` consecutive ranks, and a rollout with ``tensor_parallel_size = tp``
receives only its slice of each weight (:meth:`TrainingEngine.iter_rollout_slices
<verity.engines.base.TrainingEngine.iter_rollout_slices>`: from FSDP2 shards each rank
receives about ``1/tp`` of the weights' bytes, in the same bounded buckets). A rollout whose
``receives_slices`` is False (vLLM, whose loader cuts its own slice out of each checkpoint
tensor) gets the full tensors instead, as with ``tp = 1``; every rank of a training group
builds the same engine, so every rank takes the same path.

Every rank of the training group must call :func:`sync_weights` (gathering is a
collective); ranks without a rollout pass ``rollout=None`` and only take part in the
gathering.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from verity.resharding.gather import DEFAULT_BUCKET_BYTES, iter_full_state_dict_buckets
from verity.resharding.names import NameMapper, map_names


@dataclass
class SyncStats:
    """What one weight sync handed to the receiver: tensor count, bytes (in the sent dtype), wall seconds,
    and the bytes that reached this rank over the collectives (``received_bytes``; ``None`` where the
    gatherer does not count them).

    A rank without a receiver reports 0 tensors and 0 bytes (it only helped gather).
    """

    num_tensors: int
    num_bytes: int
    seconds: float
    received_bytes: int | None = None


@torch.no_grad()
def copy_named_tensors_into(
    module: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]], *, strict: bool = True
) -> set[str]:
    """Copy ``(name, tensor)`` pairs into ``module``'s parameters/buffers in place.

    Shapes must match; dtype and device are converted by ``copy_``. Tied parameters
    are filled through any of their names.

    Args:
        module: the receiving model (e.g. the rollout's HF model).
        named_tensors: full tensors named as in ``module.named_parameters()``.
        strict: raise ``KeyError`` for an unknown name, and after the copy if some
            parameter of ``module`` received no value.

    Returns:
        the names that were copied.
    """
    targets: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    targets.update(dict(module.named_buffers(remove_duplicate=False)))
    loaded: set[str] = set()
    filled: set[int] = set()
    for name, tensor in named_tensors:
        target = targets.get(name)
        if target is None:
            if strict:
                raise KeyError(f"weight {name!r} has no counterpart in the receiving {type(module).__name__}")
            continue
        if target.shape != tensor.shape:
            raise ValueError(
                f"weight {name!r}: shape {tuple(tensor.shape)} != receiver's {tuple(target.shape)}"
            )
        target.copy_(tensor)
        loaded.add(name)
        filled.add(id(target))
    if strict:
        missing = [n for n, p in module.named_parameters() if id(p) not in filled]
        if missing:
            raise KeyError(f"no weight was sent for {len(missing)} parameters, e.g. {missing[:5]}")
    return loaded


class ModuleWeightReceiver:
    """Makes a plain ``nn.Module`` a sync target: ``load_weights`` copies in place (in-process)."""

    def __init__(self, module: nn.Module, *, strict: bool = True) -> None:
        self.module = module
        self.strict = strict

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy the stream into :attr:`module` (see :func:`copy_named_tensors_into`)."""
        return copy_named_tensors_into(self.module, named_tensors, strict=self.strict)


def iter_engine_weights(
    engine: Any,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` of every weight of an engine or module, gathered in buckets (collective).

    Uses ``engine.iter_full_weights`` when the engine has it (names as the rollout's HF
    model names them), else gathers ``engine`` itself or its ``.model`` module.
    """
    if not isinstance(engine, nn.Module) and hasattr(engine, "iter_full_weights"):
        buckets = engine.iter_full_weights(bucket_bytes, dtype=dtype, device=device)
    else:
        module = _module_of(engine, "iter_full_weights")
        buckets = iter_full_state_dict_buckets(module, bucket_bytes, dtype=dtype, device=device)
    yield from _emptied(buckets)


def _module_of(engine: Any, method: str) -> nn.Module:
    """``engine`` itself or its ``.model`` module, for an engine without ``method``; TypeError otherwise."""
    module = engine if isinstance(engine, nn.Module) else getattr(engine, "model", None)
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"sync_weights needs a training engine with {method}() or a .model module, got {type(engine).__name__}"
        )
    return module


def _emptied(buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each bucket's ``(name, tensor)`` pairs, popped so the bucket holds no reference once consumed."""
    for bucket in buckets:
        while bucket:
            yield bucket.pop(0)


def sync_weights(
    engine: Any,
    rollout: Any | None,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    name_mapper: NameMapper | None = None,
    tensor_parallel_size: int | None = None,
) -> SyncStats:
    """Send ``engine``'s full weights to ``rollout.load_weights`` (collective over the training group).

    Args:
        engine: a training engine (its ``iter_full_weights``) or a module.
        rollout: anything with ``load_weights(iterable of (name, tensor))``, e.g.
            ``verity.rollout.HFRollout`` or :class:`ModuleWeightReceiver`; ``None`` on
            ranks that only help gather.
        bucket_bytes: gathering bucket capacity (bounds peak extra memory).
        dtype: cast floating-point weights (e.g. ``torch.bfloat16``) before sending.
        device: where gathered tensors go (default: the trainer's device).
        name_mapper: trainer name -> rollout name (``None`` skips a weight).
        tensor_parallel_size: ranks per rollout replica; each rank then receives only its slices
            (default: the rollout's ``tensor_parallel_size``, else 1). Every rank must pass the same.
            A rollout with ``receives_slices = False`` gets full tensors whatever the size.

    Returns:
        :class:`SyncStats` for this rank.
    """
    start = time.perf_counter()
    counts = {"tensors": 0, "bytes": 0}

    def counted(stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in stream:
            counts["tensors"] += 1
            counts["bytes"] += tensor.numel() * tensor.element_size()
            yield name, tensor
            del tensor  # not held while the next tensor is gathered

    tp = int(tensor_parallel_size or getattr(rollout, "tensor_parallel_size", 1) or 1)
    if not getattr(rollout, "receives_slices", True):
        tp = 1  # the engine takes full tensors and slices them itself
    wire: dict[str, int] = {}
    if tp > 1:
        full = iter_engine_slices(engine, tp, bucket_bytes, dtype=dtype, device=device, stats=wire)
    else:
        full = iter_engine_weights(engine, bucket_bytes, dtype=dtype, device=device)
    if rollout is not None:
        rollout.load_weights(counted(map_names(full, name_mapper)))
    for _ in full:  # finish the collective gathering (no receiver here, or it stopped early)
        pass
    return SyncStats(
        num_tensors=counts["tensors"],
        num_bytes=counts["bytes"],
        seconds=time.perf_counter() - start,
        received_bytes=wire.get("received_bytes"),
    )


def iter_engine_slices(
    engine: Any,
    tp_size: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    stats: dict[str, int] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, this rank's tensor-parallel slice)`` of every weight (collective; TP rank = rank % ``tp_size``).

    Uses ``engine.iter_rollout_slices`` when the engine has it, else reslices ``engine`` itself
    or its ``.model`` module (:func:`~verity.resharding.tp_reshard.iter_tp_slice_buckets`).
    """
    from verity.resharding.tp_reshard import iter_tp_slice_buckets

    if not isinstance(engine, nn.Module) and hasattr(engine, "iter_rollout_slices"):
        buckets = engine.iter_rollout_slices(tp_size, bucket_bytes, dtype=dtype, device=device, stats=stats)
    else:
        module = _module_of(engine, "iter_rollout_slices")
        buckets = iter_tp_slice_buckets(module, tp_size, bucket_bytes, dtype=dtype, device=device, stats=stats)
    yield from _emptied(buckets)
