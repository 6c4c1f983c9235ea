"""Reading a rollout's input batch and building its output batch.

A rollout takes a ``verity.batch.Batch`` (or a plain dict of tensors and
per-row lists, handy in tests and scripts) and returns a ``verity.batch.Batch``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def unpack_batch(batch: Any) -> tuple[dict[str, torch.Tensor], dict[str, list], dict[str, Any]]:
    """Split a batch into ``(tensors, non_tensors, meta)``.

    Accepts a ``verity.batch.Batch`` (``keys()``, ``b[key]``, ``non_tensors``,
    ``meta``) or a mapping whose values are tensors or per-row lists.
    """
    tensors: dict[str, torch.Tensor] = {}
    non_tensors: dict[str, list] = {}
    meta: dict[str, Any] = {}
    if isinstance(batch, Mapping):
        items = list(batch.items())
    elif hasattr(batch, "keys") and hasattr(batch, "__getitem__"):
        items = [(key, batch[key]) for key in batch.keys()]
        for key, value in dict(getattr(batch, "non_tensors", {}) or {}).items():
            items.append((key, value))
        meta = dict(getattr(batch, "meta", {}) or {})
    else:
        raise TypeError(f"batch: expected a verity Batch or a dict of tensors, got {type(batch).__name__}")
    for key, value in items:
        if isinstance(value, torch.Tensor):
            tensors[key] = value
        elif isinstance(value, list | tuple):
            non_tensors[key] = list(value)
        elif key == "meta" and isinstance(value, Mapping):
            meta.update(value)
        else:
            raise TypeError(f"batch[{key!r}]: expected a tensor or a per-row list, got {type(value).__name__}")
    return tensors, non_tensors, meta


def pack_batch(tensors: dict[str, torch.Tensor], non_tensors: dict[str, list], meta: dict[str, Any]) -> Any:
    """Build a ``verity.batch.Batch``; a plain dict (tensors, lists, and ``"meta"``) when that class is unavailable."""
    try:
        from verity.batch import Batch  # type: ignore[attr-defined]
    except ImportError:
        Batch = None  # noqa: N806
    if Batch is not None and hasattr(Batch, "from_dict"):
        return Batch.from_dict(tensors, non_tensors=non_tensors or None, meta=meta or None)
    out: dict[str, Any] = dict(tensors)
    out.update(non_tensors)
    if meta:
        out["meta"] = meta
    return out
