"""Bytes that pass through the driver: what group calls send to workers and get back.

Every :class:`~verity.controller.worker_group.WorkerGroup` call adds the tensor bytes
of its arguments (once per call: a broadcast batch is put in the object store once, a
split batch's shards add up to the batch) to ``sent`` and the tensor bytes of every
rank's answer to ``received``. The RL loop reads and resets the meter after each step
(``perf/driver_bytes_sent``, ``perf/driver_bytes_received``), so a run shows how much
data it routes through the controller — the figure to drive towards "per-row scalars
and the prompts" as more data stays on the ranks that made it.

What a ``Batch`` carries is counted as it travels: its tensors (``Tensor.nbytes``) after
:mod:`verity.controller.wire` has packed them, the row digests its resident-row handles carry
(:func:`verity.batch.resident.echo_digest_bytes`), and its per-row Python values — data
sources, ground truths, chat messages, handles — at their pickled size (the handle column as
its runs: :func:`verity.batch.resident.handle_column_bytes`; a per-row list of tensors, such
as images, at their ``nbytes``). Tensors in lists, tuples and dicts are counted too; other
Python values outside a ``Batch`` (a metrics dict of floats) and the framing of the pickled
objects are not.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Mapping
from typing import Any

import torch


def row_value_bytes(non_tensors: Mapping[str, list]) -> int:
    """Bytes of a batch's per-row Python values on the wire: each list pickled, the handle column as
    its runs, a list holding tensors as their ``nbytes`` (plus the pickled rest)."""
    from verity.batch.resident import RESIDENT, handle_column_bytes

    total = 0
    for key, values in non_tensors.items():
        if key == RESIDENT:
            total += handle_column_bytes(values)
        elif any(isinstance(v, torch.Tensor) for v in values):
            rest = [None if isinstance(v, torch.Tensor) else v for v in values]
            total += sum(int(v.nbytes) for v in values if isinstance(v, torch.Tensor))
            total += len(pickle.dumps(rest, protocol=pickle.HIGHEST_PROTOCOL))
        else:
            total += len(pickle.dumps(values, protocol=pickle.HIGHEST_PROTOCOL))
    return total


def payload_bytes(value: Any) -> int:
    """Bytes in ``value`` (see the module docstring): a tensor, a ``Batch``, or lists/tuples/dicts of
    them (0 for anything else)."""
    from verity.batch import Batch

    if isinstance(value, torch.Tensor):
        return int(value.nbytes)
    if isinstance(value, Batch):
        from verity.batch.resident import echo_digest_bytes

        tensors = sum(int(value.tensors[key].nbytes) for key in value.tensor_keys())
        return tensors + echo_digest_bytes(value) + row_value_bytes(value.non_tensors)
    if isinstance(value, list | tuple):
        return sum(payload_bytes(item) for item in value)
    if isinstance(value, dict):
        return sum(payload_bytes(item) for item in value.values())
    return 0


class TransferMeter:
    """Running totals of bytes sent to and received from workers; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sent = 0
        self.received = 0

    def add(self, *, sent: Any = None, received: Any = None) -> None:
        """Count the bytes of ``sent`` (call arguments) and ``received`` (answers)."""
        s, r = payload_bytes(sent), payload_bytes(received)
        with self._lock:
            self.sent += s
            self.received += r

    def take(self) -> tuple[int, int]:
        """``(sent, received)`` bytes since the last ``take``; resets both to 0."""
        with self._lock:
            out = (self.sent, self.received)
            self.sent = self.received = 0
        return out


DRIVER_TRANSFERS = TransferMeter()
"""The driver process's meter (group calls add to it; the RL loop takes it each step)."""
