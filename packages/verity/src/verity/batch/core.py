"""The one batch type that crosses every role boundary.

A :class:`Batch` holds ``B`` rows of three kinds of data:

* ``tensors`` - a :class:`tensordict.TensorDict` with ``batch_size == [B]``; every
  tensor has ``B`` as its first dimension (``responses`` is ``[B, R]``, ``scores`` is
  ``[B]``, ...);
* ``non_tensors`` - ``dict[str, list]`` of per-sample Python objects (prompt text,
  ground truth, ``data_source``, ...), every list of length ``B``;
* ``meta`` - a plain ``dict`` of batch-wide information (temperature, global step,
  metrics) that is not split or indexed.

Splitting for data parallelism pads: ``split(n)`` repeats rows (cycling from the first
row) until ``B`` is a multiple of ``n`` and records in each part how many of its trailing
rows are padding (``pad_rows``). ``Batch.concat`` drops those rows again, so
``Batch.concat(b.split(n))`` has exactly the rows of ``b`` in their original order.

Rows can stay on the worker that generated them: their prompt-aligned tensors are then
*resident* (:mod:`verity.batch.transport`) — listed by ``keys()`` and ``in``, carried by every
row operation as per-row handles, fetched by the worker that receives the batch, and fetched
on the driver when read there (``batch[key]`` returns the tensor either way).

Pickling (``pickle``, ``cloudpickle``, Ray) sends CPU tensors as numpy arrays, which
protocol 5 carries out of band (no ``torch.save`` round trip, zero copies in Ray's
object store); they are copied once into writable memory on the receiving side.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from verity.batch.transport import (
    RESIDENT,
    HandleRuns,
    column_sources,
    fetch_key,
    pack_tensor,
    restrict_column,
    unpack_tensor,
)

__all__ = ["Batch", "BatchError"]


class BatchError(ValueError):
    """A batch operation got inputs it cannot work with (wrong lengths, missing keys...)."""


def _as_row_list(key: str, value: Any) -> list:
    """Turn a per-sample container into a list; anything else is a TypeError naming ``key``."""
    if isinstance(value, list):
        return list(value)
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, np.ndarray) and value.ndim >= 1:
        return list(value)
    raise TypeError(
        f"batch key {key!r}: expected a torch.Tensor with the batch as first dimension or a "
        f"list of per-sample values, got {type(value).__name__}"
    )


def _values_equal(a: Any, b: Any) -> bool:
    """Equality that also works for tensors and numpy arrays inside per-sample values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and bool(torch.equal(a.cpu(), b.cpu()))
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    try:
        return bool(a == b)
    except (ValueError, TypeError):
        return a is b


class Batch:
    """``B`` rows of tensors (a TensorDict), per-sample Python objects and batch-wide meta.

    Build one with :meth:`from_dict`. ``len(batch)`` is ``B``; ``batch["key"]`` returns a
    tensor of shape ``[B, ...]`` or a list of length ``B``; ``batch[idx]`` with an int,
    slice, index list or boolean mask is :meth:`index`.
    """

    __slots__ = ("tensors", "non_tensors", "meta", "pad_rows", "_resident_memo")

    def __init__(
        self,
        tensors: TensorDict,
        non_tensors: Mapping[str, Sequence] | None = None,
        meta: Mapping[str, Any] | None = None,
        pad_rows: int = 0,
    ) -> None:
        if not isinstance(tensors, TensorDict):
            raise TypeError(f"Batch: 'tensors' must be a TensorDict, got {type(tensors).__name__}")
        if len(tensors.batch_size) != 1:
            raise BatchError(
                f"Batch: the TensorDict must have a 1-d batch_size [B], got {list(tensors.batch_size)}"
            )
        size = int(tensors.batch_size[0])
        rows: dict[str, list] = {}
        for key, value in (non_tensors or {}).items():
            _check_key_name(key)
            values = _as_row_list(key, value)
            if len(values) != size:
                raise BatchError(f"batch key {key!r}: has {len(values)} values, expected B={size}")
            if key in tensors:
                raise BatchError(f"batch key {key!r} is given both as a tensor and as a per-sample list")
            rows[key] = values
        if not 0 <= int(pad_rows) <= size:
            raise BatchError(f"Batch: pad_rows must be in [0, {size}], got {pad_rows}")
        self.tensors = tensors
        self.non_tensors = rows
        self.meta: dict[str, Any] = dict(meta or {})
        self.pad_rows = int(pad_rows)
        self._resident_memo: tuple[Any, list[str]] | None = None  # (handle column, its resident keys)

    # ------------------------------------------------------------------ building
    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, Sequence] | None = None,
        meta: Mapping[str, Any] | None = None,
        batch_size: int | None = None,
    ) -> Batch:
        """Build a batch from tensors ``[B, ...]`` and per-sample lists of length ``B``.

        ``B`` is read from the first tensor (or the first list when there are no tensors,
        or ``batch_size`` when there is neither). A tensor or list whose length differs is
        a :class:`BatchError` naming the key.
        """
        tensors = dict(tensors or {})
        non_tensors = dict(non_tensors or {})
        size, source = batch_size, "batch_size"
        for key, value in tensors.items():
            _check_key_name(key)
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"batch key {key!r}: expected a torch.Tensor, got {type(value).__name__}")
            if value.dim() == 0:
                raise BatchError(f"batch key {key!r}: a 0-d tensor has no batch dimension; expected [B, ...]")
            if size is None:
                size, source = int(value.shape[0]), f"key {key!r}"
            elif value.shape[0] != size:
                raise BatchError(
                    f"batch key {key!r}: first dimension is {value.shape[0]}, expected B={size} (from {source})"
                )
        if size is None:
            for key, value in non_tensors.items():
                size, source = len(_as_row_list(key, value)), f"key {key!r}"
                break
        size = 0 if size is None else int(size)
        td = TensorDict(tensors, batch_size=[size])
        return cls(td, non_tensors, meta)

    # ------------------------------------------------------------------ mapping API
    def __len__(self) -> int:
        return int(self.tensors.batch_size[0])

    def keys(self) -> list[str]:
        """Tensor keys, then per-sample (non-tensor) keys, then resident keys."""
        return [*self.tensor_keys(), *self.non_tensor_keys(), *self.resident_keys()]

    def tensor_keys(self) -> list[str]:
        """Keys of the tensors (each ``[B, ...]``)."""
        return list(self.tensors.keys())

    def non_tensor_keys(self) -> list[str]:
        """Keys of the per-sample Python lists (each of length ``B``; the handle column is not one)."""
        return [k for k in self.non_tensors if k != RESIDENT]

    def resident_keys(self) -> list[str]:
        """Keys whose tensors stay on the workers that made the rows (:mod:`verity.batch.transport`).

        A key is resident when every row's handle gives access to it; empty without handles.
        """
        column = self.non_tensors.get(RESIDENT)
        if not column:
            return []
        # remembered for the column object: a handle column is replaced, never changed in place,
        # and key lookups ask for it dozens of times a step (a scan of every row's handle each)
        if self._resident_memo is None or self._resident_memo[0] is not column:
            sources = column_sources(column)
            common = set(sources[0].keys).intersection(*(s.keys for s in sources[1:]))
            self._resident_memo = (column, [k for k in sources[0].keys if k in common])
        return list(self._resident_memo[1])

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str) or key == RESIDENT:
            return False
        return key in self.non_tensors or key in self.tensors or key in self.resident_keys()

    def __iter__(self):
        raise TypeError("a Batch is not iterable; use batch.keys() for its keys or batch.index(i) for rows")

    def __getitem__(self, key: Any) -> Any:
        """``batch["key"]`` -> tensor ``[B, ...]`` or list; any other key -> :meth:`index`.

        A resident key is fetched from the object store that holds its rows (counted in
        ``perf/driver_bytes_received`` on the driver) and kept in this batch as a tensor.
        """
        if isinstance(key, str):
            if key in self.non_tensors:
                return self.non_tensors[key]
            if key in self.tensors:
                return self.tensors.get(key)
            if key in self.resident_keys():
                value = fetch_key(self, key)
                self._drop_resident(key)  # from now on a key of this batch like any other
                self.tensors.set(key, value)
                return value
            raise KeyError(f"batch has no key {key!r}; keys are {self.keys()}")
        return self.index(key)

    def __setitem__(self, key: str, value: Any) -> None:
        """Set a tensor ``[B, ...]`` or a list of ``B`` per-sample values under ``key``.

        On a batch without any key yet, the first value set defines ``B``.
        """
        _check_key_name(key)
        if key == RESIDENT:
            raise BatchError(f"batch key {RESIDENT!r} is the column of resident-row handles; it is not set by hand")
        if isinstance(value, np.ndarray) and value.dtype != object:
            value = torch.as_tensor(value)
        self._drop_resident(key)  # the driver's value replaces the workers' copy
        empty = not self.keys()
        if isinstance(value, torch.Tensor):
            if value.dim() == 0:
                raise BatchError(f"batch key {key!r}: a 0-d tensor has no batch dimension; expected [B, ...]")
            if empty and value.shape[0] != len(self):
                self.tensors = TensorDict({}, batch_size=[value.shape[0]])
            if value.shape[0] != len(self):
                raise BatchError(
                    f"batch key {key!r}: first dimension is {value.shape[0]}, expected B={len(self)}"
                )
            self.non_tensors.pop(key, None)
            self.tensors.set(key, value)
            return
        values = _as_row_list(key, value)
        if empty and len(values) != len(self):
            self.tensors = TensorDict({}, batch_size=[len(values)])
        if len(values) != len(self):
            raise BatchError(f"batch key {key!r}: has {len(values)} values, expected B={len(self)}")
        if key in self.tensors:
            del self.tensors[key]
        self.non_tensors[key] = values

    def __delitem__(self, key: str) -> None:
        self.pop(key)

    def _drop_resident(self, *keys: str) -> None:
        """Stop giving access to resident ``keys`` (the handles of the other resident keys stay)."""
        resident = self.resident_keys()
        if not any(k in resident for k in keys):
            return
        kept = [k for k in resident if k not in keys]
        if kept:
            self.non_tensors[RESIDENT] = restrict_column(self.non_tensors[RESIDENT], kept)
        else:
            del self.non_tensors[RESIDENT]

    def pop(self, key: str) -> Any:
        """Remove ``key`` and return its tensor or list (a resident key is fetched first)."""
        value = self[key]
        if key in self.non_tensors:
            del self.non_tensors[key]
        else:
            del self.tensors[key]
        return value

    def __repr__(self) -> str:
        fields = ", ".join(
            f"{k}: {str(v.dtype).replace('torch.', '')}{list(v.shape)}" for k, v in self.tensors.items()
        )
        lists = ", ".join(self.non_tensor_keys())
        pad = f", pad_rows={self.pad_rows}" if self.pad_rows else ""
        resident = f", resident=[{', '.join(self.resident_keys())}]" if RESIDENT in self.non_tensors else ""
        return (
            f"Batch(B={len(self)}{pad}, tensors={{{fields}}}, non_tensors=[{lists}]{resident}, "
            f"meta={list(self.meta)})"
        )

    # ------------------------------------------------------------------ row operations
    def _row_ids(self, idx: Any) -> torch.Tensor | slice:
        """Normalise ``idx`` to a slice or a 1-d int64 tensor of row positions."""
        size = len(self)
        if isinstance(idx, slice):
            return idx
        if isinstance(idx, bool):
            raise TypeError("Batch.index: a bool is not a row index")
        if isinstance(idx, int | np.integer):
            i = int(idx)
            if not -size <= i < size:
                raise IndexError(f"Batch.index: row {i} is out of range for B={size}")
            return torch.tensor([i % size], dtype=torch.long)
        ids = torch.as_tensor(np.asarray(idx) if not isinstance(idx, torch.Tensor) else idx)
        if ids.dim() != 1:
            raise BatchError(f"Batch.index: expected a 1-d index, got shape {list(ids.shape)}")
        if ids.dtype == torch.bool:
            if ids.shape[0] != size:
                raise BatchError(f"Batch.index: boolean mask has length {ids.shape[0]}, expected B={size}")
            return ids.nonzero().flatten()
        if ids.numel() == 0:
            return ids.long()
        if ids.is_floating_point() or ids.is_complex():
            raise TypeError(f"Batch.index: row indices must be integers, got {ids.dtype}")
        ids = ids.long().cpu()
        if int(ids.max()) >= size or int(ids.min()) < -size:
            raise IndexError(f"Batch.index: indices must lie in [-{size}, {size}), got {ids.tolist()}")
        return ids % max(size, 1)

    def index(self, idx: Any) -> Batch:
        """Rows picked by an int, slice, list/array/tensor of ints, or a ``[B]`` boolean mask.

        Returns a new batch (``pad_rows`` 0); a slice returns views of the tensors.
        """
        ids = self._row_ids(idx)
        if isinstance(ids, slice):
            positions = range(len(self))[ids]
            td = self.tensors[ids]
        else:
            positions = ids.tolist()
            td = self.tensors[ids]
        rows = {k: [v[i] for i in positions] for k, v in self.non_tensors.items()}
        return Batch(td, rows, dict(self.meta))

    def select(self, *keys: str) -> Batch:
        """A batch with only ``keys`` (tensors share memory with this one)."""
        if len(keys) == 1 and isinstance(keys[0], list | tuple):
            keys = tuple(keys[0])
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"Batch.select: no key(s) {missing}; keys are {self.keys()}")
        resident = [k for k in self.resident_keys() if k in keys]
        tensor_keys = [k for k in keys if k in self.tensors]
        td = self.tensors.select(*tensor_keys) if tensor_keys else TensorDict({}, batch_size=[len(self)])
        rows = {k: self.non_tensors[k] for k in keys if k in self.non_tensors}
        if resident:
            column = self.non_tensors[RESIDENT]
            rows[RESIDENT] = column if resident == self.resident_keys() else restrict_column(column, resident)
        return Batch(td, rows, dict(self.meta), self.pad_rows)

    def repeat_interleave(self, n: int) -> Batch:
        """Each row repeated ``n`` times in place: rows ``a, b`` become ``a, a, b, b`` for n=2.

        Used for n samples per prompt; ``pad_rows`` scales by ``n``.
        """
        n = _positive_int("Batch.repeat_interleave", "n", n)
        out = self.index(torch.arange(len(self)).repeat_interleave(n))
        out.pad_rows = self.pad_rows * n
        return out

    def split(self, n: int) -> list[Batch]:
        """``n`` equal parts, padding by repeating rows until ``B`` is a multiple of ``n``.

        The padding rows are copies of the first real rows (cycling) appended at the end;
        each part records how many of its trailing rows are padding in ``pad_rows`` and
        :meth:`concat` drops them. Part ``k`` holds padded rows ``[k*s, (k+1)*s)`` with
        ``s = ceil(B / n)``.
        """
        n = _positive_int("Batch.split", "n", n)
        size = len(self)
        if size == 0:
            raise BatchError(f"cannot split an empty batch (0 rows) into {n} parts")
        real = size - self.pad_rows
        extra = (-size) % n
        source_rows = real if real > 0 else size
        order = torch.cat([torch.arange(size), torch.arange(extra) % source_rows])
        part_size = (size + extra) // n
        parts = []
        for k in range(n):
            start, stop = k * part_size, (k + 1) * part_size
            if stop <= size:
                part = self.index(slice(start, stop))
            else:
                part = self.index(order[start:stop])
            part.pad_rows = max(0, stop - max(start, real))
            parts.append(part)
        return parts

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Rows of all ``batches`` in order, without the padding rows recorded by :meth:`split`.

        All batches must have the same keys and matching trailing tensor shapes. ``meta``
        is the union of the parts' meta (the first part wins on a shared key). A key that
        one part holds and another left on the workers is read (fetched) in the latter.
        """
        batches = list(batches)
        if not batches:
            raise BatchError("Batch.concat: got an empty list of batches")
        for i, b in enumerate(batches):
            if not isinstance(b, Batch):
                raise TypeError(f"Batch.concat: item {i} is a {type(b).__name__}, expected Batch")
        held = set().union(*(b.tensor_keys() for b in batches))
        for b in batches:
            for key in b.resident_keys():
                if key in held:
                    b[key]  # noqa: B018 - reading a resident key fetches it into the batch
        first = batches[0]
        tensor_keys, list_keys = set(first.tensor_keys()), set(first.non_tensors)
        for i, b in enumerate(batches[1:], start=1):
            for mine, theirs, kind in (
                (tensor_keys, set(b.tensor_keys()), "tensor"),
                (list_keys, set(b.non_tensors), "per-sample"),
            ):
                if mine != theirs:
                    diff = sorted(mine ^ theirs)
                    raise BatchError(
                        f"Batch.concat: {kind} keys of part {i} differ from part 0 in {diff} "
                        f"(part 0 has {sorted(mine)}, part {i} has {sorted(theirs)})"
                    )
        keeps = [len(b) - b.pad_rows for b in batches]
        total = sum(keeps)
        tensors = {}
        for key in first.tensor_keys():
            pieces = [b.tensors.get(key)[:keep] for b, keep in zip(batches, keeps, strict=True)]
            try:
                tensors[key] = torch.cat(pieces, dim=0)
            except RuntimeError as err:
                shapes = [list(p.shape) for p in pieces]
                raise BatchError(
                    f"Batch.concat: cannot concatenate key {key!r} with shapes {shapes}"
                ) from err
        rows = {
            key: [v for b, keep in zip(batches, keeps, strict=True) for v in b.non_tensors[key][:keep]]
            for key in first.non_tensors
        }
        meta: dict[str, Any] = {}
        for b in batches:
            for k, v in b.meta.items():
                meta.setdefault(k, v)
        return Batch(TensorDict(tensors, batch_size=[total]), rows, meta)

    def union(self, other: Batch) -> Batch:
        """A new batch with the keys of both; keys present in both must hold equal values.

        Both batches must have the same ``B``. Shared meta keys must agree too. A mismatch
        is a :class:`BatchError` naming the key.
        """
        if not isinstance(other, Batch):
            raise TypeError(f"Batch.union: expected a Batch, got {type(other).__name__}")
        if len(self) != len(other):
            raise BatchError(f"Batch.union: batch sizes differ ({len(self)} vs {len(other)})")
        if self.pad_rows and other.pad_rows and self.pad_rows != other.pad_rows:
            raise BatchError(f"Batch.union: pad_rows differ ({self.pad_rows} vs {other.pad_rows})")
        tensors = dict(self.tensors.items())
        rows = dict(self.non_tensors)
        for key, value in other.tensors.items():
            if key in rows:
                raise BatchError(
                    f"Batch.union: key {key!r} is a per-sample list in one batch and a tensor in the other"
                )
            if key in tensors:
                mine = tensors[key]
                if mine.shape != value.shape or mine.dtype != value.dtype:
                    raise BatchError(
                        f"Batch.union: key {key!r} differs: {mine.dtype}{list(mine.shape)} vs "
                        f"{value.dtype}{list(value.shape)}"
                    )
                if not torch.equal(mine, value.to(mine.device)):
                    raise BatchError(f"Batch.union: key {key!r} has different values in the two batches")
            else:
                tensors[key] = value
        for key, values in other.non_tensors.items():
            if key in tensors:
                raise BatchError(
                    f"Batch.union: key {key!r} is a tensor in one batch and a per-sample list in the other"
                )
            if key in rows:
                if not all(_values_equal(a, b) for a, b in zip(rows[key], values, strict=True)):
                    raise BatchError(f"Batch.union: key {key!r} has different values in the two batches")
            else:
                rows[key] = values
        meta = dict(self.meta)
        for key, value in other.meta.items():
            if key in meta and not _values_equal(meta[key], value):
                raise BatchError(f"Batch.union: meta key {key!r} differs ({meta[key]!r} vs {value!r})")
            meta.setdefault(key, value)
        td = TensorDict(tensors, batch_size=[len(self)])
        joined = Batch(td, rows, meta, self.pad_rows or other.pad_rows)
        both = [k for k in joined.resident_keys() if k in tensors]
        if both:
            raise BatchError(f"Batch.union: key(s) {both} are resident in one batch and local in the other")
        return joined

    def to(self, device: str | torch.device, non_blocking: bool = False) -> Batch:
        """A batch whose tensors live on ``device`` (per-sample lists and meta are shared)."""
        td = self.tensors.to(device, non_blocking=non_blocking)
        return Batch(td, self.non_tensors, self.meta, self.pad_rows)

    def clone(self) -> Batch:
        """A deep copy of the tensors; lists and meta are copied shallowly."""
        rows = {k: list(v) for k, v in self.non_tensors.items()}
        return Batch(self.tensors.clone(), rows, dict(self.meta), self.pad_rows)

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict[str, Any]:
        packed = {}
        for key, value in self.tensors.items():
            packed[key] = pack_tensor(value)
        rows = self.non_tensors
        if RESIDENT in rows:  # a handle per row pickles as a few runs of rows
            rows = {**rows, RESIDENT: HandleRuns(rows[RESIDENT])}
        return {
            "size": len(self),
            "tensors": packed,
            "non_tensors": rows,
            "meta": self.meta,
            "pad_rows": self.pad_rows,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        tensors = {key: unpack_tensor(value) for key, value in state["tensors"].items()}
        self.tensors = TensorDict(tensors, batch_size=[state["size"]])
        rows = state["non_tensors"]
        if isinstance(rows.get(RESIDENT), HandleRuns):
            rows = {**rows, RESIDENT: rows[RESIDENT].rows()}
        self.non_tensors = rows
        self.meta = state["meta"]
        self.pad_rows = state["pad_rows"]
        self._resident_memo = None


def _check_key_name(key: Any) -> None:
    if not isinstance(key, str) or not key:
        raise TypeError(f"batch keys must be non-empty strings, got {key!r}")


def _positive_int(where: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or int(value) < 1:
        raise BatchError(f"{where}: {name} must be an integer >= 1, got {value!r}")
    return int(value)
