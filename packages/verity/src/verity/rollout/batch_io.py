"""Reading a rollout's input batch and building its output batch.

A rollout takes a :class:`verity.batch.Batch` (or a plain dict of tensors and
per-row lists, handy in tests and scripts) and returns a ``Batch``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from verity.batch import Batch


def unpack_batch(
    batch: Batch | Mapping[str, Any],
) -> tuple[dict[str, torch.Tensor], dict[str, list], dict[str, Any]]:
    """Split a batch into ``(tensors, non_tensors, meta)``.

    Accepts a ``Batch`` or a mapping whose values are tensors or per-row lists
    (an optional ``"meta"`` entry holding a dict becomes the meta).
    """
    if isinstance(batch, Batch):
        tensors = {key: batch[key] for key in batch.tensor_keys()}
        return tensors, {k: list(v) for k, v in batch.non_tensors.items()}, dict(batch.meta)
    if not isinstance(batch, Mapping):
        raise TypeError(f"batch: expected a verity Batch or a dict of tensors, got {type(batch).__name__}")
    tensors: dict[str, torch.Tensor] = {}
    non_tensors: dict[str, list] = {}
    meta: dict[str, Any] = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            tensors[key] = value
        elif key == "meta" and isinstance(value, Mapping):
            meta.update(value)
        elif isinstance(value, list | tuple):
            non_tensors[key] = list(value)
        else:
            raise TypeError(
                f"batch[{key!r}]: expected a tensor or a per-row list, got {type(value).__name__}"
            )
    return tensors, non_tensors, meta


def pack_batch(
    tensors: dict[str, torch.Tensor], non_tensors: dict[str, list], meta: dict[str, Any], pad_rows: int = 0
) -> Batch:
    """Build the output ``Batch`` (``pad_rows``: trailing padding rows recorded by ``Batch.split``)."""
    out = Batch.from_dict(tensors, non_tensors=non_tensors or None, meta=meta or None)
    out.pad_rows = pad_rows
    return out
