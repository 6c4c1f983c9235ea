"""Answers that extend their request: only what the method added or changed comes back.

A data-parallel method registered with ``extends_request=True`` (the rollout's ``generate``)
answers with the rows of its first ``Batch`` argument, in order, plus what it computed. The
request's own columns — a prompt's data source, ground truth, chat messages, group id — would
otherwise travel back to the driver that sent them. So the worker host, after the method ran,
drops from the answer every request key the method left exactly as it arrived
(:func:`drop_request_echo`) and names them in ``answer.meta[FROM_REQUEST]``; the driver puts
its own copies back from the rank's shard of the request before the answers are joined
(:func:`restore_request_echo`). The method, and whoever reads the joined answer, see what they
saw before.

"Exactly as it arrived" is checked, not assumed: a tensor is dropped only when the request's
tensor was not modified in place during the method (its version counter) and the answer's
has the same dtype, shape and bits; a per-row list only when it pickles to the same bytes as
the request's did before the method ran, and a per-row list of tensors (images) only when each
row's tensor passes the tensor test.

Columns the method never reads need not go out at all: a request whose ``meta[HELD_ON_DRIVER]``
names some of its keys is sent without them (:func:`without_held_columns`), and the driver
adds its own copies to the answer (:func:`with_held_columns`). The run names the prompt
columns no rollout-side code reads (:func:`verity.config.derived.columns_held_on_driver`).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict

from verity.batch import Batch
from verity.controller.wire import FLOAT_BITS

__all__ = [
    "FROM_REQUEST",
    "HELD_ON_DRIVER",
    "RequestSnapshot",
    "drop_request_echo",
    "held_columns",
    "restore_request_echo",
    "with_held_columns",
    "without_held_columns",
]

FROM_REQUEST = "_from_request"
"""``answer.meta`` key: ``(tensor keys in answer order, per-row keys in answer order, dropped keys)``."""

HELD_ON_DRIVER = "held_on_driver"
"""``request.meta`` key: the request's keys the method never reads (a tuple of names); they are not
sent, and come back into the answer from the driver's own request."""


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    if a.dtype in FLOAT_BITS:
        return torch.equal(a.view(FLOAT_BITS[a.dtype]), b.view(FLOAT_BITS[b.dtype]))
    return torch.equal(a, b)


def _holds_tensors(values: list) -> bool:
    return any(isinstance(v, torch.Tensor) for v in values)


def _pickled(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


@dataclass
class RequestSnapshot:
    """The request as it arrived, before the method ran: its tensors (the objects, which a method
    replacing a key in the batch does not touch) with their version counters, each per-row list's
    pickled bytes, and per-row lists of tensors item by item."""

    rows_count: int
    pad_rows: int
    tensors: dict[str, tuple[torch.Tensor, int]]
    rows: dict[str, bytes]
    tensor_rows: dict[str, list[tuple[torch.Tensor, int] | bytes]]

    @classmethod
    def take(cls, request: Batch) -> RequestSnapshot:
        """Record ``request`` as it arrived (call before the method runs)."""
        tensors = {k: (request.tensors[k], request.tensors[k]._version) for k in request.tensor_keys()}
        rows, tensor_rows = {}, {}
        for key, values in request.non_tensors.items():
            if _holds_tensors(values):  # per-row tensors (images): each one, as tensors are
                tensor_rows[key] = [
                    (v, v._version) if isinstance(v, torch.Tensor) else _pickled(v) for v in values
                ]
            else:
                rows[key] = _pickled(values)
        return cls(len(request), request.pad_rows, tensors, rows, tensor_rows)

    def unchanged_rows(self, key: str, values: list) -> bool:
        """Whether per-row list ``values`` is request key ``key`` as it arrived."""
        if key in self.rows:
            return not _holds_tensors(values) and _pickled(values) == self.rows[key]
        before = self.tensor_rows.get(key)
        if before is None or len(before) != len(values):
            return False
        for old, new in zip(before, values, strict=True):
            if isinstance(old, bytes):
                if isinstance(new, torch.Tensor) or _pickled(new) != old:
                    return False
            elif not (
                isinstance(new, torch.Tensor) and old[0]._version == old[1] and _same_bits(new, old[0])
            ):
                return False
        return True

    def unchanged_tensor(self, key: str, value: torch.Tensor) -> bool:
        """Whether ``value`` is request key ``key`` as it arrived: never written in place, same bits."""
        if key not in self.tensors:
            return False
        original, version = self.tensors[key]
        return original._version == version and _same_bits(value, original)


def drop_request_echo(snapshot: RequestSnapshot, answer: Any) -> Any:
    """``answer`` without the request keys it carries unchanged, named in ``meta[FROM_REQUEST]``.

    Anything but a ``Batch`` of the request's length is returned as it is.
    """
    if (
        not isinstance(answer, Batch)
        or len(answer) != snapshot.rows_count
        or answer.pad_rows != snapshot.pad_rows
    ):
        return answer
    dropped = [key for key in answer.tensor_keys() if snapshot.unchanged_tensor(key, answer.tensors[key])]
    dropped += [key for key, values in answer.non_tensors.items() if snapshot.unchanged_rows(key, values)]
    if not dropped:
        return answer
    gone = set(dropped)
    order = (tuple(answer.tensor_keys()), tuple(answer.non_tensors))
    kept = [k for k in answer.tensor_keys() if k not in gone]
    return Batch(
        TensorDict({k: answer.tensors[k] for k in kept}, batch_size=[len(answer)]),
        {k: v for k, v in answer.non_tensors.items() if k not in gone},
        {**answer.meta, FROM_REQUEST: (*order, tuple(dropped))},
        answer.pad_rows,
    )


def restore_request_echo(answer: Any, shard: Batch) -> Any:
    """``answer`` with the keys :func:`drop_request_echo` dropped taken back from ``shard``, the
    rank's part of the request as the driver split it; anything without the mark as it is."""
    if not isinstance(answer, Batch) or FROM_REQUEST not in answer.meta:
        return answer
    tensor_order, row_order, dropped = answer.meta[FROM_REQUEST]
    if len(shard) != len(answer):
        raise RuntimeError(
            f"an answer that extends its request has {len(answer)} rows, its request shard {len(shard)}: "
            "cannot put the request's columns back"
        )
    gone = set(dropped)
    tensors = {k: (shard.tensors[k] if k in gone else answer.tensors[k]) for k in tensor_order}
    rows = {k: (list(shard.non_tensors[k]) if k in gone else answer.non_tensors[k]) for k in row_order}
    meta = {k: v for k, v in answer.meta.items() if k != FROM_REQUEST}
    return Batch(TensorDict(tensors, batch_size=[len(answer)]), rows, meta, answer.pad_rows)


def held_columns(request: Batch) -> tuple[str, ...]:
    """The keys of ``request`` its ``meta[HELD_ON_DRIVER]`` names (those it has), in request order."""
    named = set(request.meta.get(HELD_ON_DRIVER) or ())
    return tuple(k for k in (*request.tensor_keys(), *request.non_tensor_keys()) if k in named)


def without_held_columns(request: Batch) -> Batch:
    """What goes out for ``request``: the batch without its held columns (and without the mark);
    ``request`` itself when it holds none back."""
    held = held_columns(request)
    if not held:
        return request
    names = request.keys()  # a Batch is not iterable
    sent = request.select(*(k for k in names if k not in held))
    sent.meta.pop(HELD_ON_DRIVER, None)
    return sent


def with_held_columns(answer: Any, shard: Batch) -> Any:
    """``answer`` with the columns its request shard ``shard`` held back (:func:`without_held_columns`)
    put back from ``shard``, after the answer's own keys; anything but a ``Batch`` as it is."""
    held = held_columns(shard)
    if not isinstance(answer, Batch) or not held:
        return answer
    if len(shard) != len(answer):
        raise RuntimeError(
            f"an answer that extends its request has {len(answer)} rows, its request shard {len(shard)}: "
            f"cannot put back the columns held on the driver ({', '.join(held)})"
        )
    clash = [k for k in held if k in answer]
    if clash:
        raise RuntimeError(
            f"the answer has key(s) {clash} that its request held on the driver: the method was not sent "
            "them, so it cannot have extended them; rename its own keys"
        )
    tensors = {k: answer.tensors[k] for k in answer.tensor_keys()}
    tensors.update({k: shard.tensors[k] for k in held if k in shard.tensors})
    rows = dict(answer.non_tensors)
    rows.update({k: list(shard.non_tensors[k]) for k in held if k in shard.non_tensors})
    return Batch(TensorDict(tensors, batch_size=[len(answer)]), rows, answer.meta, answer.pad_rows)
