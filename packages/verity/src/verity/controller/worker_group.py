"""Worker groups: one Ray actor per slot of a resource pool, driven as one object.

    pool = ResourcePool([4])
    wg = WorkerGroup(pool, ActorWorker, config)       # 4 ranks of ActorWorker(config)
    out = wg.compute_logprobs(batch)                  # DP_SPLIT: split, run, concat
    call = wg.compute_logprobs.submit(batch)          # same, without waiting
    out = call.result()

Each method decorated with ``verity.controller.register`` becomes an attribute of the
group that dispatches and collects as declared. A colocated group
(``WorkerGroup(pool, colocate({"actor": A, "ref": R}))``) has one attribute per role:
``wg.actor.update(batch)``, ``wg.ref.compute_ref_logprobs(batch)``.

Failures never hang the driver silently: the first rank that raises or dies ends the
call with :class:`~verity.controller.WorkerMethodError` or
:class:`~verity.controller.WorkerDiedError` naming the group, role, method and rank.
Before reporting, every rank is checked (:mod:`verity.controller.rank_failures`): a dead
rank is named as the cause even when a survivor's collective error arrived first.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from typing import Any

from verity.batch.transport import DRIVER_TRANSFERS
from verity.controller.balanced_call import BalancedGroupCall, load_balance_request
from verity.controller.dispatch import (
    CallPlan,
    Collect,
    Dispatch,
    DPLayout,
    MethodSpec,
    _check_batch,
    answer_wanted,
    collect_results,
    plan_call,
    registered_methods,
)
from verity.controller.errors import ControllerError, WorkerTimeoutError
from verity.controller.host import SINGLE_ROLE, ColocatedRoles, RoleSpec, WorkerHost
from verity.controller.load_balance import LOAD_BALANCE_META
from verity.controller.placement import describe_node
from verity.controller.rank_failures import explain_failure
from verity.controller.resource_pool import ResourcePool

__all__ = ["GroupCall", "GroupMethod", "RoleView", "WorkerGroup"]

_ADHOC = MethodSpec(Dispatch.BROADCAST, Collect.ALL, check_schema=False)
_ADHOC_RANK_ZERO = MethodSpec(Dispatch.RANK_ZERO, Collect.RANK_ZERO, check_schema=False)
# a second Ray concurrency group in every worker, so stacks() answers while a method runs
DIAGNOSTICS_GROUP = "verity_diagnostics"
_remote_host_cls = None


def _remote_host() -> Any:
    global _remote_host_cls
    if _remote_host_cls is None:
        import ray

        _remote_host_cls = ray.remote(concurrency_groups={DIAGNOSTICS_GROUP: 1})(WorkerHost)
    return _remote_host_cls


class GroupCall:
    """A group call in flight; :meth:`result` waits and returns the collected answer."""

    def __init__(
        self,
        group: WorkerGroup,
        role: str,
        method: str,
        spec: MethodSpec,
        plan: CallPlan,
        refs: list,
    ) -> None:
        self._group, self._role, self._method, self._spec, self._plan = group, role, method, spec, plan
        self.refs = refs
        self._layouts = list(group._layouts[role])
        self._done = False
        self._value: Any = None

    def result(self, timeout_s: float | None = None) -> Any:
        """Wait for every called rank and return the collected answer (see ``Collect``)."""
        if self._done:
            return self._value
        group = self._group
        ranks = [rank for rank, _, _ in self._plan.calls]
        answers = group._gather(self.refs, ranks, self._role, self._method, timeout_s or group.call_timeout_s)
        DRIVER_TRANSFERS.add(received=[answer for answer, _ in answers.values()])  # as they travelled
        for rank, (_, layout) in answers.items():
            group._layouts[self._role][rank] = layout
        layouts = self._layouts if self._spec.dispatch is Dispatch.DP_SPLIT else group._layouts[self._role]
        label = group._label(self._role, self._method)
        self._value = collect_results(
            label, self._spec, self._plan, {r: a for r, (a, _) in answers.items()}, layouts
        )
        self._done = True
        return self._value


class GroupMethod:
    """A worker method bound to a group: calling it runs it on the ranks its dispatch mode picks."""

    def __init__(self, group: WorkerGroup, role: str, name: str, spec: MethodSpec) -> None:
        self._group, self._role, self.name, self.spec = group, role, name, spec

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.submit(*args, **kwargs).result()

    def submit(self, *args: Any, **kwargs: Any) -> GroupCall | BalancedGroupCall:
        """Dispatch without waiting; returns a :class:`GroupCall` (a :class:`BalancedGroupCall` for a
        load-balanced batch, :mod:`verity.controller.load_balance`)."""
        return self._group._submit(self._role, self.name, self.spec, args, kwargs)

    def __repr__(self) -> str:
        return f"<group method {self._group._label(self._role, self.name)} {self.spec.dispatch.name}/{self.spec.collect.name}>"


class RoleView:
    """One role of a colocated group: its registered methods as group calls."""

    def __init__(self, group: WorkerGroup, role: str, cls: type) -> None:
        self._group, self._role, self._cls = group, role, cls
        for name, spec in registered_methods(cls).items():
            if name in _RESERVED_ROLE_ATTRS:
                raise ValueError(
                    f"WorkerGroup: method {cls.__name__}.{name} clashes with a worker-group attribute"
                )
            setattr(self, name, GroupMethod(group, role, name, spec))

    @property
    def group(self) -> WorkerGroup:
        """The worker group this role lives in (shared by every colocated role)."""
        return self._group

    def execute_all(self, method: str, *args: Any, **kwargs: Any) -> list:
        """Call ``method`` on every rank with the same arguments; answers in rank order."""
        return self._group._adhoc(self._role, method, _ADHOC, args, kwargs)

    def execute_rank_zero(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` on rank 0 only and return its answer."""
        return self._group._adhoc(self._role, method, _ADHOC_RANK_ZERO, args, kwargs)


_RESERVED_ROLE_ATTRS = set(dir(RoleView)) | {"_group", "_role", "_cls"}


class WorkerGroup:
    """``pool.world_size`` Ray actors of ``worker_cls`` (or of several colocated roles).

    Args:
        pool: the slots to run in; rank ``i`` runs in slot ``i``.
        worker_cls: a ``Worker`` subclass (built as ``worker_cls(*args, **kwargs)`` in
            every rank) or the result of ``colocate({...})``.
        name: used in error messages (default: the class name).
        env_vars: extra environment variables exported in every worker before the role
            objects are built.
        call_timeout_s: default limit for each group call (None: wait as long as it takes;
            errors and dead workers still end the call at once).
        start_timeout_s: limit for starting the workers and building the role objects.
    """

    def __init__(
        self,
        pool: ResourcePool,
        worker_cls: type | ColocatedRoles,
        *args: Any,
        name: str | None = None,
        env_vars: Mapping[str, str] | None = None,
        call_timeout_s: float | None = None,
        start_timeout_s: float = 300.0,
        **kwargs: Any,
    ) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not isinstance(pool, ResourcePool):
            raise TypeError(f"WorkerGroup: pool must be a ResourcePool, got {type(pool).__name__}")
        if isinstance(worker_cls, ColocatedRoles):
            if args or kwargs:
                raise TypeError(
                    "WorkerGroup: give colocated roles their arguments with role(cls, *args, **kwargs)"
                )
            roles = dict(worker_cls.roles)
            self.name = name or "+".join(roles)
        else:
            roles = {SINGLE_ROLE: RoleSpec(worker_cls, tuple(args), dict(kwargs))}
            self.name = name or worker_cls.__name__
        self._colocated = isinstance(worker_cls, ColocatedRoles)
        self._role_classes = {role_name: spec.cls for role_name, spec in roles.items()}
        self.pool = pool
        self.call_timeout_s = call_timeout_s
        self._hosts: list[Any] = []
        self._closed = False
        self._bind(roles)

        remote_host = _remote_host()
        options = pool.actor_options()
        self._hosts = [
            remote_host.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg,
                    placement_group_bundle_index=index,
                    placement_group_capture_child_tasks=True,
                ),
                **options,
            ).remote()
            for pg, index in pool.slots
        ]
        try:
            first = self._gather(
                [self._hosts[0].rendezvous_address.remote()], [0], "host", "start", start_timeout_s
            )
            master_addr, master_port = first[0]
            envs = self._rank_envs(master_addr, master_port, dict(env_vars or {}))
            refs = [host.setup.remote(env, roles) for host, env in zip(self._hosts, envs, strict=True)]
            built = self._gather(
                refs, list(range(self.world_size)), "+".join(roles), "__init__", start_timeout_s
            )
        except BaseException:
            self.shutdown()
            raise
        self._layouts: dict[str, list[DPLayout]] = {
            role_name: [built[rank][role_name] for rank in range(self.world_size)] for role_name in roles
        }

    # ------------------------------------------------------------------ setup helpers
    def _bind(self, roles: dict[str, RoleSpec]) -> None:
        reserved = set(dir(type(self))) | set(vars(self)) | {"_layouts"}
        if self._colocated:
            for role_name, spec in roles.items():
                if role_name in reserved:
                    raise ValueError(
                        f"WorkerGroup: role name {role_name!r} clashes with a WorkerGroup attribute"
                    )
                setattr(self, role_name, RoleView(self, role_name, spec.cls))
            return
        cls = roles[SINGLE_ROLE].cls
        for method_name, spec in registered_methods(cls).items():
            if method_name in reserved:
                raise ValueError(
                    f"WorkerGroup: method {cls.__name__}.{method_name} clashes with a WorkerGroup attribute"
                )
            setattr(self, method_name, GroupMethod(self, SINGLE_ROLE, method_name, spec))

    def _rank_envs(self, master_addr: str, master_port: int, extra: dict[str, str]) -> list[dict[str, str]]:
        node_ids = self.pool.slot_node_ids
        node_rank = {node: i for i, node in enumerate(dict.fromkeys(node_ids))}
        per_node = {node: node_ids.count(node) for node in node_rank}
        seen: dict[str, int] = {}
        envs = []
        for rank, node in enumerate(node_ids):
            local_rank = seen.get(node, 0)
            seen[node] = local_rank + 1
            env = {str(k): str(v) for k, v in extra.items()}
            env.update(
                RANK=str(rank),
                WORLD_SIZE=str(self.world_size),
                LOCAL_RANK=str(local_rank),
                LOCAL_WORLD_SIZE=str(per_node[node]),
                NODE_RANK=str(node_rank[node]),
                MASTER_ADDR=str(master_addr),
                MASTER_PORT=str(master_port),
                VERITY_WORKER_GROUP=self.name,
            )
            envs.append(env)
        return envs

    # ------------------------------------------------------------------ calls
    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return self.pool.world_size

    @property
    def workers(self) -> list[Any]:
        """The Ray actor handles, in rank order."""
        return list(self._hosts)

    @property
    def roles(self) -> list[str]:
        """Role names (``["worker"]`` for a plain group)."""
        return list(self._role_classes)

    def _label(self, role: str, method: str) -> str:
        return f"{self.name}.{method}" if role == SINGLE_ROLE else f"{self.name}/{role}.{method}"

    def _submit(
        self, role: str, method: str, spec: MethodSpec, args: tuple, kwargs: dict
    ) -> GroupCall | BalancedGroupCall:
        import ray

        if self._closed:
            raise ControllerError(f"worker group {self.name!r} was shut down; cannot call {method}")
        label = self._label(role, method)
        if spec.dispatch is Dispatch.DP_SPLIT:
            balanced = self._balanced(role, method, spec, args, kwargs)
            if isinstance(balanced, BalancedGroupCall):
                return balanced
            args, kwargs = balanced
        plan = plan_call(label, spec, args, kwargs, self._layouts[role], share=ray.put)
        DRIVER_TRANSFERS.add(sent=plan.payload)
        refs = [
            self._hosts[rank].call.remote(role, method, answer_wanted(spec, rank), *a, **kw)
            for rank, a, kw in plan.calls
        ]
        return GroupCall(self, role, method, spec, plan, refs)

    def _balanced(
        self, role: str, method: str, spec: MethodSpec, args: tuple, kwargs: dict
    ) -> BalancedGroupCall | tuple[tuple, dict]:
        """A load-balanced call where the batch asks for one and there are several replicas to balance
        over (:mod:`verity.controller.load_balance`); otherwise the arguments without the request."""
        request, batch = load_balance_request(args, kwargs)
        if request is None:
            return args, kwargs
        layouts = [layout.layout_for(spec.layout) for layout in self._layouts[role]]
        if len({layout.dp_size for layout in layouts}) == 1 and layouts[0].dp_size > 1 and len(batch):
            if spec.check_schema:
                _check_batch(self._label(role, method), "argument 0", batch)
            return BalancedGroupCall(self, role, method, spec, batch, request)
        plain = batch.select(*batch.keys())
        plain.pad_rows = batch.pad_rows
        plain.meta.pop(LOAD_BALANCE_META, None)
        return (plain,), {}

    def _adhoc(self, role: str, method: str, spec: MethodSpec, args: tuple, kwargs: dict) -> Any:
        cls = self._role_classes[role]
        if not callable(getattr(cls, method, None)):
            raise AttributeError(
                f"worker group {self.name!r}: role class {cls.__name__} has no method {method!r}"
            )
        return self._submit(role, method, spec, args, kwargs).result()

    def _single_role(self, method: str) -> tuple[str, str]:
        if not self._colocated:
            return SINGLE_ROLE, method
        role, _, name = method.partition(".")
        if not name or role not in self._role_classes:
            raise ValueError(
                f"worker group {self.name!r} is colocated; name the role as 'role.method' (roles: {self.roles}), "
                f"got {method!r}"
            )
        return role, name

    def execute_all(self, method: str, *args: Any, **kwargs: Any) -> list:
        """Call ``method`` (``"role.method"`` in a colocated group) on every rank; answers in rank order."""
        role, name = self._single_role(method)
        return self._adhoc(role, name, _ADHOC, args, kwargs)

    def execute_rank_zero(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` on rank 0 only and return its answer."""
        role, name = self._single_role(method)
        return self._adhoc(role, name, _ADHOC_RANK_ZERO, args, kwargs)

    def worker_info(self) -> list[dict[str, Any]]:
        """Per rank: ``pid``, ``node_id``, ``ip``, the rank environment variables, role names."""
        if self._closed:
            raise ControllerError(f"worker group {self.name!r} was shut down")
        refs = [host.info.remote() for host in self._hosts]
        found = self._gather(refs, list(range(self.world_size)), "host", "info", self.call_timeout_s)
        return [found[rank] for rank in range(self.world_size)]

    def memory_peaks(self) -> dict[str, tuple[int | None, int]]:
        """``{"<role>/<method>": (device bytes or None, host bytes)}``: each method's memory peak since the
        last call (:meth:`WorkerHost.memory_peaks`), the largest over the ranks."""
        if self._closed:
            raise ControllerError(f"worker group {self.name!r} was shut down")
        ranks = list(range(len(self._hosts)))
        found = self._gather([host.memory_peaks.remote() for host in self._hosts], ranks, "host", "memory_peaks", self.call_timeout_s)
        peaks: dict[str, tuple[int | None, int]] = {}
        for rank in ranks:
            for name, (device, host) in found[rank].items():
                if name in peaks:
                    before_device, before_host = peaks[name]
                    device = device if before_device is None else max(before_device, device or 0)
                    host = max(before_host, host)
                peaks[name] = (device, host)
        return peaks

    def stacks(self, timeout_s: float = 10.0) -> dict[int, dict[str, Any] | None]:
        """Per rank, what it is doing now (``WorkerHost.stacks``), even while a group method runs.

        Answers come from a separate concurrency group of each worker. A rank that does
        not answer within ``timeout_s`` (dead, or stuck holding the GIL) maps to None.
        """
        import ray

        if self._closed:
            return {}
        refs = [host.stacks.options(concurrency_group=DIAGNOSTICS_GROUP).remote() for host in self._hosts]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        done = set(ready)
        found: dict[int, dict[str, Any] | None] = {}
        for rank, ref in enumerate(refs):
            found[rank] = None
            if ref in done:
                with contextlib.suppress(Exception):
                    found[rank] = ray.get(ref)
        return found

    def _gather(
        self, refs: list, ranks: list[int], role: str, method: str, timeout_s: float | None
    ) -> dict[int, Any]:
        """Wait for ``refs`` (one per rank in ``ranks``), failing on the first error or death."""
        import ray
        from ray.exceptions import GetTimeoutError, RayError

        label = self._label(role, method) if role != "host" else f"{self.name}.{method}"
        rank_of = {ref: rank for ref, rank in zip(refs, ranks, strict=True)}
        found: dict[int, Any] = {}
        pending = list(refs)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        where = {"group": self.name, "role": role, "method": method}
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                late = sorted(rank_of[ref] for ref in pending)
                raise WorkerTimeoutError(
                    f"{label}: rank(s) {late} did not answer within {timeout_s:g} s", rank=late[0], **where
                )
            ref = ready[0]
            rank = rank_of[ref]
            try:
                found[rank] = ray.get(ref)
            except (RayError, GetTimeoutError) as err:
                # the first failure may be a survivor's collective error: check every rank first
                raise explain_failure(
                    label=label,
                    where=where,
                    rank=rank,
                    error=err,
                    pending=pending,
                    rank_of=rank_of,
                    ping=self._ping,
                    world_size=len(self._hosts),
                    node_of=self._node_of,
                ) from err
        return found

    def _node_of(self, rank: int) -> str:
        """``node 10.0.0.2/ab12cd34``, with ``(that node left the cluster)`` when Ray lost the node itself."""
        return describe_node(self.pool.slot_node_ids[rank])

    def _ping(self, rank: int) -> Any:
        """A liveness check of ``rank`` on its diagnostics concurrency group (answers while a method runs)."""
        return self._hosts[rank].stacks.options(concurrency_group=DIAGNOSTICS_GROUP).remote()

    # ------------------------------------------------------------------ lifetime
    def shutdown(self) -> None:
        """Kill the worker actors (the pool's reservation stays; call ``pool.remove()`` to free it)."""
        import ray

        for host in self._hosts:
            with contextlib.suppress(Exception):  # already dead, or Ray shut down
                ray.kill(host)
        self._hosts = []
        self._closed = True

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "shut down" if self._closed else f"{self.world_size} ranks"
        return f"WorkerGroup({self.name!r}, roles={self.roles}, {state})"
