"""Bytes that pass through the driver: what group calls send to workers and get back.

Every :class:`~verity.controller.worker_group.WorkerGroup` call adds the tensor bytes
of its arguments (once per call: a broadcast batch is put in the object store once, a
split batch's shards add up to the batch) to ``sent`` and the tensor bytes of every
rank's answer to ``received``. The RL loop reads and resets the meter after each step
(``perf/driver_bytes_sent``, ``perf/driver_bytes_received``), so a run shows how much
data it routes through the controller — the figure to drive towards "per-row scalars
and the prompts" as more data stays on the ranks that made it.

Only tensors are counted (``Tensor.nbytes``, inside a ``Batch``, list, tuple or dict),
as they travel: after :mod:`verity.controller.wire` has packed them, and the row digests a
batch's resident-row handles carry (:func:`verity.batch.resident.echo_digest_bytes`).
Per-row Python values (strings, ints) are small beside them and are left out.
"""

from __future__ import annotations

import threading
from typing import Any

import torch


def payload_bytes(value: Any) -> int:
    """Tensor bytes in ``value``: a tensor, a ``Batch``, or lists/tuples/dicts of them (0 for anything else)."""
    from verity.batch import Batch

    if isinstance(value, torch.Tensor):
        return int(value.nbytes)
    if isinstance(value, Batch):
        from verity.batch.resident import echo_digest_bytes

        return sum(int(value.tensors[key].nbytes) for key in value.tensor_keys()) + echo_digest_bytes(value)
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
        """Count the tensor bytes of ``sent`` (call arguments) and ``received`` (answers)."""
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
