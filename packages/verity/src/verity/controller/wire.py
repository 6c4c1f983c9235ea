"""Smaller tensors on the wire between the driver and the workers, restored exactly on arrival.

Group calls move ``Batch`` es between the driver and the worker processes. Many of their
tensors carry far fewer bits than their dtype: masks and token ids are ``int64`` with values
that fit 8, 16 or 32 bits, and an outcome-reward advantage is one number per row broadcast
over its ``R`` response positions. Before a batch leaves (:func:`pack`), each tensor
is stored in its smallest exact form:

- a 2-D tensor whose every row repeats its first column, bit for bit (``-0.0`` and NaN
  payloads included), as that column ``[B, 1]``;
- a 2-D float32 or float64 tensor whose every row is one value on a prefix of its columns
  and that value times 0 after it — an outcome advantage ``A x response_mask`` over
  right-padded responses — as ``[B, 2]`` integers: the value's bits and the prefix length,
  kept only when ``value * (column < length)`` gives back every bit;
- a 2-D integer tensor whose every row is one value on a prefix of its columns and 0 after
  it (a ``response_mask`` over right-padded responses), or 0 and then one value on a suffix
  (the ``attention_mask`` of left-padded prompts), as ``[B, 2]`` (value, length) pairs in
  the narrowest integer dtype that holds them;
- a 2-D integer tensor whose every row counts up from 0 after a run of 0s,
  ``max(column - start, 0)`` (the ``position_ids`` of left-padded prompts), as its
  ``start`` per row ``[B, 1]``;
- a 1-D float or integer tensor whose every element has the same bits (a step where every
  sample scored 0, an accuracy no row had) as that element's bits in the code and a ``[B, 0]``
  tensor;
- an integer tensor in the narrowest integer dtype that holds its values (``int8``,
  ``int16``, ``int32``), and so a float tensor whose every value is a whole number (0/1
  scores and accuracies; not ``-0.0``, NaN or infinities).

A batch whose rows are each of fewer rows repeated ``n`` times in a row — the generate
stage's prompts, one copy per sample — says so in ``meta[REPEATED_ROWS] = n``; it then goes
as one copy of each row (``meta[ROW_REPEATS] = n``) when that is exact and each data-parallel
rank's part holds whole runs, and the receiver repeats the rows again (:func:`unpack_batch`).

The batch's ``meta`` records what was done under :data:`WIRE_META`, so the receiver
(:func:`unpack`) restores the original shapes and dtypes: the method on the other side
sees the tensors it would have seen without packing, bit for bit. Packing happens before
a split call is planned, so each rank's shard (``Batch.split``) carries its part packed.
Other float tensors (beyond row-constant ones), bool tensors and tensors of other ranks are
left as they are. ``perf/driver_bytes_*`` count the packed bytes: what actually moved.
"""

from __future__ import annotations

from typing import Any

import torch

from verity.batch import Batch

WIRE_META = "_wire"
"""``batch.meta`` key of a packed batch: ``{key: (width or None, dtype name or None)}``."""

REPEATED_ROWS = "repeated_rows"
"""``batch.meta`` key a sender sets to ``n`` when every row of the batch is one of ``len / n`` rows
repeated ``n`` times in a row (``Batch.repeat_interleave(n)``): the rows may go once each."""

ROW_REPEATS = "_row_repeats"
"""``batch.meta`` key of a batch sent as one copy of each run of repeated rows: the copies per row."""

_NARROW_INTS = (torch.int8, torch.int16, torch.int32)
FLOAT_BITS = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}
"""The integer dtype of each float dtype's width: ``tensor.view(FLOAT_BITS[dtype])`` compares bits."""


def _rows_repeat_first_column(tensor: torch.Tensor) -> bool:
    """Whether every row of a 2-D tensor equals its first column bit for bit."""
    bits = tensor.view(FLOAT_BITS[tensor.dtype]) if tensor.dtype in FLOAT_BITS else tensor
    return bool((bits == bits[:, :1]).all())


PREFIX = "prefix:"
"""Code prefix of a tensor packed as (row value, prefix length) pairs; the original dtype follows."""
SUFFIX = "suffix:"
"""Code prefix of an integer tensor packed as (row value, suffix length) pairs; the original dtype follows."""
RAMP = "ramp:"
"""Code prefix of an integer tensor packed as one ``start`` per row of ``max(column - start, 0)``."""
FILL = "fill:"
"""Code prefix of a 1-D tensor whose every element has the same bits: ``fill:<dtype>:<bits>``, the
element's bits as an integer in the code, the tensor itself ``[B, 0]`` (no bytes, still ``B`` rows
so that it splits with the batch)."""


def _masked_prefix_rows(tensor: torch.Tensor) -> torch.Tensor | None:
    """``[B, 2]`` (value bits, prefix length) when every row of a 2-D float32/float64 tensor is
    ``value * (column < length)`` bit for bit, else None."""
    if tensor.dtype not in (torch.float32, torch.float64) or tensor.shape[1] < 2:
        return None
    bits = tensor.view(FLOAT_BITS[tensor.dtype])
    same = bits == bits[:, :1]
    # the prefix: columns before the first one that differs from the row's first value
    length = torch.where(same.all(-1), tensor.shape[1], (~same).to(torch.int8).argmax(-1))
    if not torch.equal(_prefix_rows(tensor[:, 0], length, tensor.shape[1]).view(bits.dtype), bits):
        return None
    return torch.stack([bits[:, 0], length.to(bits.dtype)], dim=1)


def _prefix_rows(values: torch.Tensor, length: torch.Tensor, width: int) -> torch.Tensor:
    """``values[:, None] * (column < length[:, None])`` over ``width`` columns, in ``values``' dtype."""
    inside = torch.arange(width)[None, :] < length[:, None]
    return values[:, None] * inside.to(values.dtype)


def _is_integer(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is an integer type (not float, complex or bool)."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _int_run_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, str] | None:
    """``([B, 2] (value, length) pairs, PREFIX or SUFFIX)`` when every row of a 2-D integer
    tensor is ``value * (column < length)`` (prefix) or ``value * (column >= width - length)``
    (suffix), else None. The pairs are narrowed to the smallest integer dtype holding them."""
    if not _is_integer(tensor.dtype):
        return None
    width = tensor.shape[1]
    if width < 3:  # two columns or fewer: the pairs are no smaller
        return None
    for kind, rows in ((PREFIX, tensor), (SUFFIX, tensor.flip(1))):
        values = rows[:, 0]
        same = rows == values[:, None]
        length = torch.where(same.all(-1), width, (~same).to(torch.int8).argmax(-1))
        if torch.equal(_prefix_rows(values, length, width), rows):
            pairs = torch.stack([values, length.to(tensor.dtype)], dim=1)
            narrow = _narrowest_int(pairs)
            return (pairs if narrow is None else pairs.to(narrow)), kind
    return None


def _ramp(start: torch.Tensor, width: int) -> torch.Tensor:
    """``max(column - start[:, None], 0)`` over ``width`` columns, in ``start``'s dtype."""
    return (torch.arange(width, dtype=start.dtype)[None, :] - start[:, None]).clamp(min=0)


def _ramp_rows(tensor: torch.Tensor) -> torch.Tensor | None:
    """``[B, 1]`` starts, narrowed, when every row of a 2-D integer tensor is ``max(column - start, 0)``."""
    if not _is_integer(tensor.dtype):
        return None
    width = tensor.shape[1]
    if width < 3:
        return None
    start = (width - 1) - tensor[:, -1]  # the last column reads width - 1 - start
    if not torch.equal(_ramp(start, width), tensor):
        return None
    narrow = _narrowest_int(start)
    return (start if narrow is None else start.to(narrow))[:, None]


def _narrowest_int(tensor: torch.Tensor) -> torch.dtype | None:
    """The narrowest integer dtype holding every value of an integer tensor (None: no narrower one)."""
    if tensor.numel() == 0:
        return None
    low, high = int(tensor.min()), int(tensor.max())
    for dtype in _NARROW_INTS:
        if torch.iinfo(dtype).bits >= torch.iinfo(tensor.dtype).bits:
            return None
        info = torch.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return dtype
    return None


def _integral_float_int(tensor: torch.Tensor) -> torch.dtype | None:
    """The narrowest integer dtype that holds a float tensor exactly — every value finite, whole
    and not ``-0.0`` (0/1 scores and accuracies) — or None."""
    if tensor.numel() == 0 or not torch.isfinite(tensor).all() or not (tensor == tensor.trunc()).all():
        return None
    if (torch.signbit(tensor) & (tensor == 0)).any():
        return None
    low, high = float(tensor.min()), float(tensor.max())
    for dtype in _NARROW_INTS:
        if torch.iinfo(dtype).bits >= torch.finfo(tensor.dtype).bits:
            return None
        info = torch.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return dtype
    return None


def pack_tensor(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int | None, str | None] | None]:
    """``(packed tensor, code)``; ``code`` is None when the tensor is sent as it is.

    ``code = (width, dtype)``: ``width`` is the original second dimension when the rows were
    cut to their first column, ``dtype`` the original dtype's name when the values were
    narrowed; ``(width, "prefix:<dtype>")`` / ``(width, "suffix:<dtype>")`` for (value, prefix
    or suffix length) pairs, ``(width, "ramp:<dtype>")`` for one start per row of a count from
    0 after left padding, ``(None, "fill:<dtype>:<bits>")`` for a 1-D tensor of one repeated
    element, sent as ``[B, 0]`` (see the module docstring).
    """
    if tensor.device.type != "cpu" or tensor.dim() == 0 or tensor.shape[0] == 0:
        return tensor, None
    width = None
    if (
        tensor.dim() == 1
        and tensor.shape[0] > 1
        and (tensor.dtype in FLOAT_BITS or _is_integer(tensor.dtype))
        and _rows_repeat_first_column(tensor[None, :])
    ):
        bits = tensor[:1].view(FLOAT_BITS.get(tensor.dtype, tensor.dtype))
        name = str(tensor.dtype).removeprefix("torch.")
        return tensor.new_empty((tensor.shape[0], 0)), (None, f"{FILL}{name}:{int(bits.item())}")
    if (
        tensor.dim() == 2
        and tensor.shape[1] > 1
        and tensor.dtype != torch.bool
        and _rows_repeat_first_column(tensor)
    ):
        width = int(tensor.shape[1])
        tensor = tensor[:, :1].contiguous()
    elif tensor.dim() == 2 and (pairs := _masked_prefix_rows(tensor)) is not None:
        return pairs, (int(tensor.shape[1]), PREFIX + str(tensor.dtype).removeprefix("torch."))
    elif tensor.dim() == 2 and (runs := _int_run_rows(tensor)) is not None:
        pairs, kind = runs
        return pairs, (int(tensor.shape[1]), kind + str(tensor.dtype).removeprefix("torch."))
    elif tensor.dim() == 2 and (starts := _ramp_rows(tensor)) is not None:
        return starts, (int(tensor.shape[1]), RAMP + str(tensor.dtype).removeprefix("torch."))
    dtype_name = None
    if _is_integer(tensor.dtype) or tensor.is_floating_point():
        narrow = _narrowest_int(tensor) if _is_integer(tensor.dtype) else _integral_float_int(tensor)
        if narrow is not None:
            dtype_name = str(tensor.dtype).removeprefix("torch.")
            tensor = tensor.to(narrow)
    if width is None and dtype_name is None:
        return tensor, None
    return tensor, (width, dtype_name)


def unpack_tensor(tensor: torch.Tensor, code: tuple[int | None, str | None]) -> torch.Tensor:
    """The tensor :func:`pack_tensor` was given, from its packed form and ``code``."""
    width, dtype_name = code
    if dtype_name is not None and dtype_name.startswith(FILL):
        name, _, bits = dtype_name.removeprefix(FILL).partition(":")
        dtype = getattr(torch, name)
        value = torch.tensor([int(bits)], dtype=FLOAT_BITS.get(dtype, dtype)).view(dtype)
        return value.expand(tensor.shape[0]).contiguous()
    if dtype_name is not None and dtype_name.startswith(RAMP):
        return _ramp(tensor[:, 0].to(getattr(torch, dtype_name.removeprefix(RAMP))), width)
    if dtype_name is not None and dtype_name.startswith((PREFIX, SUFFIX)):
        kind, _, name = dtype_name.partition(":")
        dtype = getattr(torch, name)
        if dtype.is_floating_point:  # the value's bits
            return _prefix_rows(tensor[:, 0].view(dtype), tensor[:, 1], width)
        rows = _prefix_rows(tensor[:, 0].to(dtype), tensor[:, 1].long(), width)
        return rows if kind + ":" == PREFIX else rows.flip(1).contiguous()
    if dtype_name is not None:
        tensor = tensor.to(getattr(torch, dtype_name))
    if width is not None:
        tensor = tensor.expand(tensor.shape[0], width).contiguous()
    return tensor


def _same_rows(a: Batch, b: Batch) -> bool:
    """Whether two batches hold the same tensors (bit for bit) and the same per-row values."""
    if a.tensor_keys() != b.tensor_keys() or set(a.non_tensors) != set(b.non_tensors):
        return False
    for key in a.tensor_keys():
        x, y = a.tensors[key], b.tensors[key]
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if x.dtype in FLOAT_BITS:
            x, y = x.view(FLOAT_BITS[x.dtype]), y.view(FLOAT_BITS[y.dtype])
        if not torch.equal(x, y):
            return False
    for key, values in a.non_tensors.items():
        for x, y in zip(values, b.non_tensors[key], strict=True):
            if x is y:
                continue
            try:
                if not bool(x == y):
                    return False
            except Exception:  # noqa: BLE001 - values without a plain equality (tensors, arrays): not the same
                return False
    return True


def compact_repeats(batch: Batch, parts: int = 1) -> Batch:
    """``batch`` with the :data:`REPEATED_ROWS` mark taken off; sent as one copy of each run of
    repeated rows (marked :data:`ROW_REPEATS`) when the runs are exactly that and ``parts``
    data-parallel parts of it hold whole runs each, so that each part of the copies, repeated
    again, is the part the full batch would have given."""
    n = batch.meta.get(REPEATED_ROWS)
    if n is None:
        return batch
    meta = {k: v for k, v in batch.meta.items() if k != REPEATED_ROWS}
    plain = Batch(batch.tensors, dict(batch.non_tensors), meta, batch.pad_rows)
    if not isinstance(n, int) or n < 2 or len(batch) % n or (len(batch) // n) % parts:
        return plain
    if batch.pad_rows or batch.resident_keys() or ROW_REPEATS in meta:
        return plain
    once = plain.index(torch.arange(0, len(batch), n))
    if not _same_rows(once.repeat_interleave(n), plain):
        return plain
    once.meta[ROW_REPEATS] = n
    return once


def expand_repeats(batch: Batch) -> Batch:
    """``batch`` with every row repeated :data:`ROW_REPEATS` times again (the same object when unmarked)."""
    n = batch.meta.get(ROW_REPEATS)
    if n is None:
        return batch
    out = batch.repeat_interleave(n)
    out.meta = {k: v for k, v in out.meta.items() if k != ROW_REPEATS}
    return out


def pack_batch(batch: Batch, parts: int = 1) -> Batch:
    """A copy of ``batch`` with its tensors packed (the same object when nothing shrinks).

    ``parts``: the data-parallel parts the batch will be split into (for :func:`compact_repeats`).
    """
    batch = compact_repeats(batch, parts)
    if WIRE_META in batch.meta:
        return batch  # already packed
    codes: dict[str, tuple[int | None, str | None]] = {}
    tensors: dict[str, torch.Tensor] = {}
    for key in batch.tensor_keys():
        packed, code = pack_tensor(batch.tensors[key])
        tensors[key] = packed
        if code is not None:
            codes[key] = code
    if not codes:
        return batch
    return _rebuilt(batch, tensors, {**batch.meta, WIRE_META: codes})


def unpack_batch(batch: Batch) -> Batch:
    """``batch`` as it was before :func:`pack_batch` (the same object when it was not packed);
    rows sent once per run of repeats are repeated again."""
    codes = batch.meta.get(WIRE_META)
    if not codes:
        return expand_repeats(batch)
    tensors = {key: batch.tensors[key] for key in batch.tensor_keys()}
    for key, code in codes.items():
        tensors[key] = unpack_tensor(tensors[key], code)
    meta = {k: v for k, v in batch.meta.items() if k != WIRE_META}
    return expand_repeats(_rebuilt(batch, tensors, meta))


def _rebuilt(batch: Batch, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Batch:
    from tensordict import TensorDict

    td = TensorDict(tensors, batch_size=[len(batch)])
    return Batch(td, dict(batch.non_tensors), meta, batch.pad_rows)


def pack(value: Any, parts: int = 1) -> Any:
    """``value`` with every ``Batch`` in it (directly, or in a tuple, list or dict) packed;
    ``parts``: the data-parallel parts a split call will cut each batch into."""
    return _map_batches(value, lambda batch: pack_batch(batch, parts))


def unpack(value: Any) -> Any:
    """``value`` with every packed ``Batch`` in it restored."""
    return _map_batches(value, unpack_batch)


def _map_batches(value: Any, fn: Any) -> Any:
    if isinstance(value, Batch):
        return fn(value)
    if isinstance(value, tuple):
        return tuple(_map_batches(v, fn) for v in value)
    if isinstance(value, list):
        return [_map_batches(v, fn) for v in value]
    if isinstance(value, dict):
        return {k: _map_batches(v, fn) for k, v in value.items()}
    return value


__all__ = [
    "REPEATED_ROWS",
    "ROW_REPEATS",
    "WIRE_META",
    "compact_repeats",
    "expand_repeats",
    "pack",
    "pack_batch",
    "pack_tensor",
    "unpack",
    "unpack_batch",
    "unpack_tensor",
]
