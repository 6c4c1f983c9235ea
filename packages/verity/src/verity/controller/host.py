"""The process that hosts one rank of a worker group, and colocation of several roles in it.

Every rank of a :class:`~verity.controller.WorkerGroup` is one Ray actor of
:class:`WorkerHost`. The host holds one object per role: a single role for a plain
group, several for a colocated group built with :func:`colocate` (actor, rollout and
reference in one process, sharing memory and the device). Roles in one host reach each
other with ``Worker.peer(name)``. Every method the host runs is measured: its peak device and
host memory, under ``<role>/<method>`` (:mod:`verity.hardware.memory`; :meth:`WorkerHost.memory_peaks`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from verity.batch import Batch, materialize
from verity.controller.dispatch import DPLayout
from verity.controller.worker import Worker, open_rendezvous_store
from verity.hardware.memory import PeakMeter, release_free_host_memory

__all__ = ["ColocatedRoles", "RoleSpec", "WorkerHost", "colocate", "role"]

SINGLE_ROLE = "worker"


@dataclass(frozen=True)
class RoleSpec:
    """A role class with the arguments its constructor gets in every rank."""

    cls: type
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (isinstance(self.cls, type) and issubclass(self.cls, Worker)):
            raise TypeError(f"a role class must be a subclass of verity.controller.Worker, got {self.cls!r}")


def role(cls: type, *args: Any, **kwargs: Any) -> RoleSpec:
    """``role(ActorWorker, config)``: a role class with its constructor arguments."""
    return RoleSpec(cls, tuple(args), dict(kwargs))


@dataclass(frozen=True)
class ColocatedRoles:
    """Several roles that share every worker process of one group (see :func:`colocate`)."""

    roles: dict[str, RoleSpec]


def colocate(roles: Mapping[str, type | RoleSpec]) -> ColocatedRoles:
    """Put several roles in the same worker processes: ``colocate({"actor": Actor, "ref": role(Ref, cfg)})``.

    Pass the result to ``WorkerGroup`` in place of a worker class; the group then has one
    attribute per role (``wg.actor.update(batch)``, ``wg.ref.compute_ref_logprobs(batch)``).
    Roles are built in the given order; names must be identifiers not starting with ``_``.
    """
    if not roles:
        raise ValueError("colocate: give at least one role")
    specs: dict[str, RoleSpec] = {}
    for name, value in roles.items():
        if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
            raise ValueError(f"colocate: role name {name!r} must be an identifier not starting with '_'")
        specs[name] = value if isinstance(value, RoleSpec) else RoleSpec(value)
    return ColocatedRoles(specs)


def _setup_logging(env: dict[str, str]) -> None:
    """The engines' INFO lines to this rank's log file, warnings to the console (:mod:`.worker_logs`)."""
    from verity.controller.worker_logs import LOG_DIR_ENV, setup_worker_logging

    if env.get("VERITY_WORKER_DEVICE"):
        on_cpu = env["VERITY_WORKER_DEVICE"] == "cpu"
    else:
        import torch

        on_cpu = not torch.cuda.is_available()
    setup_worker_logging(
        env.get(LOG_DIR_ENV), env.get("VERITY_WORKER_GROUP", "group"), env.get("RANK", "0"), on_cpu
    )


def _layout_of(obj: Any) -> DPLayout:
    return obj._dp_layout()


class WorkerHost:
    """One rank of a worker group: builds the role objects and runs their methods.

    Used as a Ray actor class by the worker group; not meant to be built directly.
    """

    def __init__(self) -> None:
        self._roles: dict[str, Any] = {}
        self._busy: tuple[str, str, float, int] | None = None  # role, method, start (epoch s), thread id
        self._meter: PeakMeter | None = None

    def rendezvous_address(self) -> tuple[str, int]:
        """``(node IP, port)`` for ``MASTER_ADDR``/``MASTER_PORT``: this process's rendezvous store, already listening."""
        import ray

        host = ray.util.get_node_ip_address()
        return host, open_rendezvous_store(host)

    def setup(self, env: dict[str, str], roles: dict[str, RoleSpec]) -> dict[str, DPLayout]:
        """Export ``env``, load the plug-ins, then build the role objects in order; return their layouts.

        Plug-ins (:mod:`verity.plugins`) load here, in the worker process, before any role
        is built, so what they register (engines, stages' worker-side code, reward sources)
        exists where the roles run.
        """
        from verity.plugins import load_plugins

        os.environ.update(env)
        _setup_logging(env)
        self._meter = PeakMeter.for_this_process()
        load_plugins()
        peers: dict[str, Any] = {}
        for name, spec in roles.items():
            obj = spec.cls(*spec.args, **spec.kwargs)
            obj._verity_peers = peers
            peers[name] = obj
        self._roles = peers
        return {name: _layout_of(obj) for name, obj in peers.items()}

    def call(
        self, role_name: str, method: str, answer_wanted: bool, /, *args: Any, **kwargs: Any
    ) -> tuple[Any, DPLayout]:
        """Run ``role.method(*args, **kwargs)``; return the answer and the role's current layout.

        Batch arguments with resident rows (:mod:`verity.batch.transport`) are materialized first:
        the method always sees whole rows, as sent. Without ``answer_wanted`` (the driver reads only another rank's, ``dispatch.answer_wanted``)
        the answer is ``None``.
        """
        obj = self._roles[role_name]
        self._busy = (role_name, method, time.time(), threading.get_ident())
        try:
            # rows that stayed on the workers that made them are fetched here, never through the driver
            args = tuple(materialize(a) if isinstance(a, Batch) else a for a in args)
            kwargs = {k: materialize(v) if isinstance(v, Batch) else v for k, v in kwargs.items()}
            named = os.environ.get("VERITY_WORKER_GROUP", role_name) if role_name == SINGLE_ROLE else role_name
            with self._meter.measure(f"{named}/{method}") if self._meter else contextlib.nullcontext():
                answer = getattr(obj, method)(*args, **kwargs)
            release_free_host_memory()  # what the call freed goes back to the node, not kept for the next
            if not answer_wanted:
                answer = None
        finally:
            self._busy = None
        return answer, _layout_of(obj)

    def memory_peaks(self) -> dict[str, tuple[int | None, int]]:
        """``{"<role>/<method>": (device bytes or None, host bytes)}``: each method's peak since the last call; cleared."""
        taken = self._meter.take() if self._meter is not None else {}
        return {name: (peak.device, peak.host) for name, peak in taken.items()}

    def stacks(self) -> dict[str, Any]:
        """What this rank is doing: the group method running now (if any) and every thread's stack.

        Meant to be called on a separate concurrency group (the worker group does) so it
        answers while a method runs. Returns ``{"pid", "busy", "threads"}`` where ``busy``
        is None or ``{"role", "method", "seconds", "stack"}`` (``stack``: the formatted
        Python stack of the thread running it) and ``threads`` maps thread names to stacks.
        """
        busy = self._busy
        me = threading.get_ident()
        names = {t.ident: t.name for t in threading.enumerate()}
        stacks = {
            ident: "".join(traceback.format_stack(frame))
            for ident, frame in sys._current_frames().items()
            if ident != me
        }
        out: dict[str, Any] = {
            "pid": os.getpid(),
            "busy": None,
            "threads": {f"{names.get(ident, 'thread')} ({ident})": text for ident, text in stacks.items()},
        }
        if busy is not None:
            role_name, method, started, ident = busy
            out["busy"] = {
                "role": role_name,
                "method": method,
                "seconds": time.time() - started,
                "stack": stacks.get(ident, ""),
            }
        return out

    def info(self) -> dict[str, Any]:
        """Where this rank runs: pid, node id and IP, CPU niceness, rank variables, role names."""
        import ray

        keys = (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "NODE_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
        )
        return {
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "niceness": os.nice(0),
            "env": {k: os.environ.get(k) for k in keys},
            "roles": list(self._roles),
        }
