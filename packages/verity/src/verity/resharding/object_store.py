"""Cross-process weight sync through Ray's object store: the trainer publishes buckets, the rollout loads them.

In ``trainer.mode=async`` the rollout runs in its own worker group (other processes),
so the in-process copy of :func:`~verity.resharding.sync_weights` cannot reach it.
Instead, after each update:

1. every rank of the training group gathers the full weights bucket by bucket (the
   engine's ``iter_full_weights``, a collective); rank 0 moves each bucket to host memory
   and puts it in the object store (:func:`publish_weight_buckets`), one object per bucket
   (at most ``bucket_bytes`` each), and returns the object references;
2. the driver hands the references to every rank of the rollout group, which fetches the
   buckets one at a time and copies them into its engine with ``load_weights``
   (:func:`load_weight_buckets`): peak extra memory is one bucket, not the model.

On one machine the object store is shared memory; across machines Ray moves the buckets.
The bytes counted are the tensors' bytes in the dtype sent.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from verity.resharding.gather import DEFAULT_BUCKET_BYTES, iter_full_state_dict_buckets


@dataclass
class PublishedWeights:
    """What rank 0 of the training group put in the object store for one sync.

    Attributes:
        refs: one Ray object reference per bucket; each bucket is a list of ``(name, CPU tensor)``.
        num_tensors / num_bytes: what the buckets hold (bytes in the dtype sent).
        seconds: wall seconds to gather and put (on rank 0).
    """

    refs: list[Any] = field(default_factory=list)
    num_tensors: int = 0
    num_bytes: int = 0
    seconds: float = 0.0


def _buckets(
    engine: Any, bucket_bytes: int, dtype: torch.dtype | None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    if not isinstance(engine, nn.Module) and hasattr(engine, "iter_full_weights"):
        return engine.iter_full_weights(bucket_bytes, dtype=dtype, device="cpu")
    module = engine if isinstance(engine, nn.Module) else getattr(engine, "model", None)
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"cannot read weights from {type(engine).__name__}: no iter_full_weights() and no .model"
        )
    return iter_full_state_dict_buckets(module, bucket_bytes, dtype=dtype, device="cpu")


def publish_weight_buckets(
    engine: Any,
    *,
    publish: bool,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
) -> PublishedWeights:
    """Gather ``engine``'s full weights (collective) and, where ``publish``, put each bucket in the object store.

    Every rank of the training group calls it; exactly one (rank 0) passes ``publish=True``.
    Tensors are copied to host memory, contiguous and detached, before ``ray.put``.

    Returns:
        :class:`PublishedWeights` (empty on ranks that only helped gather).
    """
    import ray

    start = time.perf_counter()
    out = PublishedWeights()
    for bucket in _buckets(engine, bucket_bytes, dtype):
        if not publish:
            continue
        host = [(name, tensor.detach().to("cpu").contiguous()) for name, tensor in bucket]
        out.num_tensors += len(host)
        out.num_bytes += sum(t.numel() * t.element_size() for _, t in host)
        out.refs.append(ray.put(host))
    out.seconds = time.perf_counter() - start
    return out


def load_weight_buckets(refs: list[Any], receiver: Any) -> tuple[int, float]:
    """Fetch the buckets behind ``refs`` one at a time into ``receiver.load_weights``.

    Args:
        refs: the references of :class:`PublishedWeights` (in order).
        receiver: a rollout engine (or :class:`~verity.resharding.ModuleWeightReceiver`).

    Returns:
        ``(bytes loaded, wall seconds)``.
    """
    import ray

    start = time.perf_counter()
    loaded = {"bytes": 0}

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for ref in refs:
            for name, tensor in ray.get(ref):
                loaded["bytes"] += tensor.numel() * tensor.element_size()
                yield name, tensor

    receiver.load_weights(stream())
    return loaded["bytes"], time.perf_counter() - start
