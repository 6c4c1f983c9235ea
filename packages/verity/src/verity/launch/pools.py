"""Where a run's roles go: one pool request per worker group, planned on the cluster before anything starts.

    requests = pool_requests(cfg, backend)          # the actor's pool (with its colocated roles) + one per separate role
    plan = plan_run(cfg, backend)                   # after Ray is up: waits for nodes, or stops with one sentence
    print(plan.describe())                          # role -> node -> ranks

Every role is colocated with the actor (its processes, its nodes: ``trainer.nnodes`` x
``trainer.n_workers_per_node``) or placed ``separate`` on a pool of its own, shaped by its
section's ``n_workers`` and ``nnodes`` (``critic``, ``reward_model``, ``rollout`` for the async
rollout group, a plug-in's section such as ``prm``). Roles are read from the role registry, so a
plug-in role is placed like a built-in one.

The plan comes from :func:`verity.controller.placement.plan_placement`. On a joined cluster a plan
that does not fit yet is tried again while nodes join, for ``trainer.placement_timeout_s``; a
shape no node of the cluster could ever hold, or a private cluster (which never grows), is refused
at once. Either way the error is one sentence, a :class:`~verity.controller.placement.PlacementError`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from verity.config.cluster_checks import cluster_address, model_parallel_size
from verity.config.errors import ConfigError
from verity.controller.placement import (
    PlacementError,
    PlacementPlan,
    PoolRequest,
    cluster_nodes,
    never_fits,
    plan_placement,
)
from verity.workers.registry import RoleDef, enabled_roles, role_placement

__all__ = ["ACTOR_POOL", "RoleShape", "bundle", "plan_run", "pool_requests", "role_shapes"]

#: the name of the pool the actor and every colocated role run in
ACTOR_POOL = "actor"
_POLL_S = 1.0


@dataclass(frozen=True)
class RoleShape:
    """How one role is placed: ``colocated`` (in the actor's pool) or ``separate`` with its own size."""

    placement: str
    n_workers: int
    nnodes: int | None


def _role_nnodes(role: RoleDef, cfg: Any) -> int | None:
    if role.name == "actor":
        t = cfg.trainer
        if t.nnodes is None and t.n_workers_per_node is not None:
            return t.n_workers // t.n_workers_per_node
        return t.nnodes
    section = getattr(cfg, role.section, None) if role.section else None
    return getattr(section, "nnodes", None)


def role_shapes(cfg: Any) -> dict[str, RoleShape]:
    """Every enabled role's shape, the actor first."""
    shapes = {}
    for role in enabled_roles(cfg):
        placement, n_workers = role_placement(role, cfg)
        shapes[role.name] = RoleShape(
            placement,
            n_workers,
            _role_nnodes(role, cfg) if placement == "separate" or role.name == "actor" else None,
        )
    return shapes


def bundle(cfg: Any, backend: Any) -> dict[str, float]:
    """One worker's reservation: ``trainer.cpus_per_worker`` CPUs, plus one device where the backend has one."""
    out = {"CPU": float(cfg.trainer.cpus_per_worker)}
    if backend.ray_resource != "CPU":
        out[backend.ray_resource] = 1.0
    return out


def pool_requests(cfg: Any, backend: Any) -> list[PoolRequest]:
    """The pools this run reserves, in creation order: the actor's (its colocated roles in it), then each separate role's."""
    shapes = role_shapes(cfg)
    one = bundle(cfg, backend)
    colocated = tuple(name for name, shape in shapes.items() if shape.placement == "colocated")
    actor = shapes["actor"]
    try:
        requests = [
            PoolRequest(
                ACTOR_POOL, actor.n_workers, one, actor.nnodes, colocated, group_size=model_parallel_size(cfg)
            )
        ]
        requests += [
            PoolRequest(name, shape.n_workers, one, shape.nnodes, (name,))
            for name, shape in shapes.items()
            if shape.placement == "separate"
        ]
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return requests


def plan_run(cfg: Any, backend: Any, joined: bool | None = None) -> PlacementPlan:
    """Plan every pool on the running Ray cluster; on a joined cluster wait up to ``trainer.placement_timeout_s`` for nodes.

    ``joined``: whether the cluster is one the run joined (default: it has an address to join,
    :func:`~verity.config.cluster_checks.cluster_address`).
    """
    requests = pool_requests(cfg, backend)
    joined = cluster_address(cfg) is not None if joined is None else joined
    timeout_s = float(cfg.trainer.placement_timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        nodes = cluster_nodes()
        try:
            return plan_placement(requests, nodes)
        except PlacementError as err:
            hopeless = [r.name for r in requests if never_fits(r, nodes)]
            if not joined or hopeless or time.monotonic() >= deadline:
                raise PlacementError(_sentence(err, joined, hopeless, timeout_s)) from None
        time.sleep(_POLL_S)


def _sentence(err: PlacementError, joined: bool, hopeless: list[str], timeout_s: float) -> str:
    if not joined:
        return f"{err} (a private cluster of this machine; set trainer.ray_address to join a larger one)"
    if hopeless:
        return f"{err}; no node of this cluster, even idle, holds one node's share of {', '.join(hopeless)}"
    return f"{err}; waited {timeout_s:g} s for nodes to join (trainer.placement_timeout_s)"
