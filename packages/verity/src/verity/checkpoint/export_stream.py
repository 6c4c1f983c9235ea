"""A role's DCP checkpoint written out as safetensors shards, one bounded bucket at a time.

The DCP metadata gives every model tensor's full shape and dtype. The tensors are cut, in
order, into buckets of at most ``max_shard_bytes`` (a tensor larger than that is a bucket
of its own); each bucket is read with one ``dcp.load`` of just its keys (DCP reads only
the requested tensors, from however many shard files the training workers wrote), cast,
written as one safetensors file, and dropped. Host memory holds one bucket, not the
model. The file names and ``model.safetensors.index.json`` follow transformers' layout,
so ``from_pretrained`` loads the folder; a model that fits one bucket is one
``model.safetensors``.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

__all__ = ["DEFAULT_SHARD_BYTES", "plan_buckets", "saved_model_tensors", "write_safetensors_shards"]

DEFAULT_SHARD_BYTES = 2 * 1024**3  # bytes of one output file (and of host memory while exporting)


def saved_model_tensors(dcp_folder: Path, prefix: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{name without prefix: (shape, dtype)}`` of every saved tensor whose key starts with ``prefix``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(dcp_folder)).read_metadata()
    return {
        key[len(prefix) :]: (tuple(item.size), item.properties.dtype)
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(item, TensorStorageMetadata)
    }


def plan_buckets(
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]],
    names: Iterable[str],
    out_dtype: torch.dtype | None,
    max_bytes: int,
) -> list[list[str]]:
    """``names`` in order, cut into runs of at most ``max_bytes`` (in ``out_dtype``, or as saved)."""
    buckets: list[list[str]] = [[]]
    size = 0
    for name in names:
        shape, dtype = tensors[name]
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * (out_dtype or dtype).itemsize
        if buckets[-1] and size + nbytes > max_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(name)
        size += nbytes
    return [b for b in buckets if b]


def _load_bucket(
    dcp_folder: Path, prefix: str, tensors: dict[str, tuple[tuple[int, ...], torch.dtype]], names: list[str]
) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    state = {prefix + n: torch.empty(tensors[n][0], dtype=tensors[n][1]) for n in names}
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": single process on purpose
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=FileSystemReader(str(dcp_folder)), no_dist=True)
    return {n: state[prefix + n] for n in names}


def _buckets(
    dcp_folder: Path,
    prefix: str,
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]],
    plan: list[list[str]],
) -> Iterator[dict[str, torch.Tensor]]:
    for names in plan:
        yield _load_bucket(dcp_folder, prefix, tensors, names)


def write_safetensors_shards(
    dcp_folder: Path,
    prefix: str,
    names: list[str],
    out: Path,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> list[Path]:
    """Write the saved tensors ``names`` (keys ``prefix + name`` in ``dcp_folder``) under ``out``.

    Returns the files written. ``dtype``: cast every tensor (None: as saved).
    """
    from safetensors.torch import save_file

    tensors = saved_model_tensors(dcp_folder, prefix)
    plan = plan_buckets(tensors, names, dtype, max_shard_bytes)
    count = len(plan)
    files = (
        ["model.safetensors"]
        if count == 1
        else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    )
    weight_map: dict[str, str] = {}
    total = 0
    for file, bucket in zip(files, _buckets(dcp_folder, prefix, tensors, plan), strict=True):
        if dtype is not None:
            bucket = {n: t.to(dtype) for n, t in bucket.items()}
        save_file(bucket, str(out / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in bucket.values())
        weight_map.update(dict.fromkeys(bucket, file))
        del bucket
    if count > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(
            json.dumps(index, indent=2) + "\n", encoding="utf-8"
        )
    return [out / f for f in files]
