"""The base class of every role that runs inside a worker group.

A worker group sets, in each worker process before the role objects are built:

* ``RANK``, ``WORLD_SIZE`` - the worker's place in the group;
* ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` - its place among the group's workers on its node;
* ``NODE_RANK`` - the index of its node among the group's nodes;
* ``MASTER_ADDR``, ``MASTER_PORT`` - rank 0's node IP and the port of the rendezvous
  store there,

as under ``torchrun``. The store is already listening when the port is handed out: rank 0's
process opens it on a port the system picks (:func:`open_rendezvous_store`) and keeps it
until :meth:`Worker.init_process_group` uses it, so no other process on the machine can take
the port in between (choosing a free port, closing it and binding it again later lost that
race when other jobs started processes at the same time). Outside a worker group (a plain
process) a Worker is rank 0 of 1.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from typing import Any

from verity.controller.dispatch import DPLayout

__all__ = ["Worker", "open_rendezvous_store"]

_RENDEZVOUS_STORE: Any = None  # rank 0's listening TCPStore, until its process group takes it


def open_rendezvous_store(host: str, timeout_s: float = 300.0) -> int:
    """Open this process's rendezvous store (a ``TCPStore`` server) on a free port of ``host``; return the port.

    Called in rank 0's process before the ranks learn ``MASTER_PORT``; the store stays open
    for :meth:`Worker.init_process_group`.
    """
    import torch.distributed as dist

    global _RENDEZVOUS_STORE
    _RENDEZVOUS_STORE = dist.TCPStore(
        host,
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return int(_RENDEZVOUS_STORE.port)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


class Worker:
    """A role object living in one worker process of a group (rank ``rank`` of ``world_size``).

    Subclasses define methods decorated with ``verity.controller.register``. Data-parallel
    layout defaults to one shard per rank; call :meth:`set_dp_layout` after building a
    device mesh with tensor or pipeline parallelism.
    """

    _verity_dp_layout: DPLayout | None = None
    _verity_named_layouts: dict[str, DPLayout] | None = None
    _verity_peers: dict[str, Any] | None = None

    @property
    def rank(self) -> int:
        """Global rank in the worker group (``RANK``)."""
        return _env_int("RANK", 0)

    @property
    def world_size(self) -> int:
        """Number of workers in the group (``WORLD_SIZE``)."""
        return _env_int("WORLD_SIZE", 1)

    @property
    def local_rank(self) -> int:
        """Rank among the group's workers on this node (``LOCAL_RANK``)."""
        return _env_int("LOCAL_RANK", 0)

    @property
    def local_world_size(self) -> int:
        """Number of the group's workers on this node (``LOCAL_WORLD_SIZE``)."""
        return _env_int("LOCAL_WORLD_SIZE", 1)

    @property
    def dp_rank(self) -> int:
        """Index of the data-parallel shard this worker processes."""
        return self._dp_layout().dp_rank

    @property
    def dp_size(self) -> int:
        """Number of data-parallel shards."""
        return self._dp_layout().dp_size

    @property
    def is_dp_collector(self) -> bool:
        """Whether this worker's answer is collected for its shard (one per shard)."""
        return self._dp_layout().is_collector

    def _dp_layout(self) -> DPLayout:
        main = self._verity_dp_layout or DPLayout(self.rank, self.world_size, True)
        if self._verity_named_layouts:
            return dataclasses.replace(main, named=tuple(sorted(self._verity_named_layouts.items())))
        return main

    def set_dp_layout(
        self, dp_rank: int, dp_size: int, is_dp_collector: bool = True, *, name: str | None = None
    ) -> None:
        """Declare this worker's data-parallel shard (e.g. ``rank // tp_size`` of ``world // tp_size``).

        Exactly one worker per shard must be the collector; the group checks this at the
        next data-parallel call. ``name``: declare a named layout instead of the main one,
        used by the methods registered with ``layout=name`` (``verity.controller.dispatch``).
        """
        if not isinstance(dp_size, int) or dp_size < 1:
            raise ValueError(f"set_dp_layout: dp_size must be an int >= 1, got {dp_size!r}")
        if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
            raise ValueError(f"set_dp_layout: dp_rank must be an int in [0, {dp_size}), got {dp_rank!r}")
        layout = DPLayout(dp_rank, dp_size, bool(is_dp_collector))
        if name is None:
            self._verity_dp_layout = layout
        else:
            self._verity_named_layouts = {**(self._verity_named_layouts or {}), name: layout}

    def init_process_group(self, backend: str = "gloo", timeout_s: float = 300.0) -> None:
        """Join the group's ``torch.distributed`` process group through the store at ``MASTER_ADDR:MASTER_PORT``.

        Rank 0 uses the store its process already opened (:func:`open_rendezvous_store`),
        or else opens one there; the other ranks connect to it. Does nothing if this
        process already joined one (colocated roles share it). ``backend``: ``"gloo"`` on
        CPU, ``"nccl"``/``"hccl"`` on accelerators.
        """
        import torch.distributed as dist

        global _RENDEZVOUS_STORE
        if dist.is_initialized():
            return
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
        if missing and self.world_size > 1:
            raise RuntimeError(f"init_process_group: environment variables {missing} are not set")
        if missing:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29500")
        timeout = datetime.timedelta(seconds=timeout_s)
        store = None
        if self.rank == 0:  # the store this process opened when the group handed out its port
            store, _RENDEZVOUS_STORE = _RENDEZVOUS_STORE, None
        if store is None:
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                is_master=self.rank == 0,
                wait_for_workers=False,
                timeout=timeout,
            )
        dist.init_process_group(
            backend=backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout
        )

    def peer(self, role: str) -> Any:
        """The role object named ``role`` living in this same process (colocated groups)."""
        peers = self._verity_peers
        if peers is None:
            raise RuntimeError("peer(): this worker is not part of a worker group (or is still being built)")
        if role not in peers:
            raise KeyError(f"peer(): no role {role!r} in this process; roles are {sorted(peers)}")
        return peers[role]
