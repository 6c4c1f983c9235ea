"""Placement plans: which node each worker of each pool runs on, decided before anything is reserved.

A run asks for a few pools (the actor's, and one per role placed ``separate``), each as
:class:`PoolRequest`: ``n_workers`` workers of one bundle (``{"CPU": 1, "GPU": 1}``) on
``nnodes`` nodes, the same number on each (``None``: the fewest nodes that hold them).
:func:`plan_placement` turns the requests and the cluster's nodes into a
:class:`PlacementPlan`, pure Python (no Ray), so a plan for 4 nodes x 8 GPUs is checked
on a laptop:

    plan = plan_placement([PoolRequest("actor", 16, {"CPU": 1, "GPU": 1}, nnodes=2)], nodes)
    plan.pools[0].rank_nodes      # [node_a] * 8 + [node_b] * 8: ranks ordered node by node
    print(plan.describe())        # role -> node -> ranks, the table a run prints at start

The rules, in order:

* ranks are ordered node by node: rank ``r`` runs on the ``r // per_node``-th node of its
  pool, so ranks ``0..per_node-1`` share a node (tensor / pipeline groups of consecutive
  ranks stay inside a node; data parallelism crosses nodes);
* pools are placed in the order asked (the actor first); each takes what the earlier ones
  left, so two pools never count the same GPU twice;
* among the nodes that fit, a pool takes those no earlier pool uses first (a role placed
  ``separate`` lands apart from the actor where the cluster has room), then in the
  cluster's order: the driver's node first, then by IP address and node id;
* a request the cluster cannot hold raises :class:`PlacementError` with one sentence naming
  the pool, what it asked and what each node has free.

:class:`verity.controller.ResourcePool` then reserves one placement group per chosen node,
each pinned to its node (Ray's ``ray.io/node-id`` label), so the reservation is the plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from verity.controller.errors import ResourceUnavailableError

__all__ = [
    "NodeInfo",
    "PlacementError",
    "PlacementPlan",
    "PoolPlacement",
    "PoolRequest",
    "cluster_nodes",
    "describe_node",
    "describe_nodes",
    "format_resources",
    "never_fits",
    "placement_record",
    "plan_placement",
]

_EPS = 1e-9


class PlacementError(ResourceUnavailableError):
    """A pool of the run cannot be placed on the cluster; the message is one sentence saying why."""


@dataclass(frozen=True)
class NodeInfo:
    """One alive node: its Ray id, IP address and total resources (``CPU``, ``GPU``, custom; no memory)."""

    node_id: str
    ip: str
    resources: dict[str, float]
    is_driver: bool = False

    @property
    def label(self) -> str:
        """``ip/abcdef12``: short enough to print, unique on a cluster whose nodes share an IP."""
        return f"{self.ip}/{self.node_id[:8]}"


@dataclass(frozen=True)
class PoolRequest:
    """One pool to place: ``n_workers`` bundles on ``nnodes`` nodes (``None``: choose), ``roles`` it runs."""

    name: str
    n_workers: int
    bundle: dict[str, float]
    nnodes: int | None = None
    roles: tuple[str, ...] = ()
    group_size: int = 1  # consecutive ranks that must share a node (a tensor-parallel group)

    def __post_init__(self) -> None:
        if self.n_workers < 1:
            raise ValueError(f"pool {self.name!r}: n_workers must be >= 1, got {self.n_workers}")
        if self.nnodes is not None and (self.nnodes < 1 or self.n_workers % self.nnodes):
            raise ValueError(
                f"pool {self.name!r}: {self.n_workers} workers do not divide over nnodes = {self.nnodes} nodes"
            )
        if self.group_size < 1 or self.n_workers % self.group_size:
            raise ValueError(
                f"pool {self.name!r}: {self.n_workers} workers do not divide into groups of {self.group_size}"
            )


@dataclass(frozen=True)
class PoolPlacement:
    """Where one pool runs: ``per_node`` bundles on each of ``nodes``, ranks node by node."""

    name: str
    roles: tuple[str, ...]
    bundle: dict[str, float]
    nodes: tuple[NodeInfo, ...]
    per_node: int

    @property
    def n_workers(self) -> int:
        """Ranks of the pool (= ``len(nodes) * per_node``)."""
        return len(self.nodes) * self.per_node

    @property
    def rank_nodes(self) -> list[str]:
        """Node id of each rank, rank 0 first."""
        return [node.node_id for node in self.nodes for _ in range(self.per_node)]

    def rank_ranges(self) -> list[tuple[NodeInfo, range]]:
        """``(node, ranks on it)`` for each node of the pool."""
        return [
            (node, range(i * self.per_node, (i + 1) * self.per_node)) for i, node in enumerate(self.nodes)
        ]


@dataclass
class PlacementPlan:
    """The placement of every pool of a run, in the order the pools are created."""

    pools: list[PoolPlacement] = field(default_factory=list)

    def pool(self, name: str) -> PoolPlacement:
        """The placement of the pool called ``name`` (``KeyError`` naming the pools otherwise)."""
        for placed in self.pools:
            if placed.name == name:
                return placed
        raise KeyError(f"no pool {name!r} in the plan; pools: {[p.name for p in self.pools]}")

    @property
    def nodes(self) -> list[NodeInfo]:
        """Every node the plan uses, in first-use order."""
        seen: dict[str, NodeInfo] = {}
        for placed in self.pools:
            for node in placed.nodes:
                seen.setdefault(node.node_id, node)
        return list(seen.values())

    def describe(self) -> str:
        """One line per pool and node: ``actor+reference  node 10.0.0.1/ab12cd34  ranks 0-7  {CPU: 1, GPU: 1} each``."""
        lines = []
        width = max((len("+".join(p.roles) or p.name) for p in self.pools), default=0)
        for placed in self.pools:
            label = "+".join(placed.roles) or placed.name
            for node, ranks in placed.rank_ranges():
                lines.append(
                    f"{label:<{width}}  node {node.label}  ranks {_span(ranks)}  {format_resources(placed.bundle)} each"
                )
        return "\n".join(lines)

    def as_record(self) -> dict[str, str]:
        """Flat strings for ``summary.json`` ``ran`` and MLflow tags.

        ``{"placement.actor": "10.0.0.1/ab12cd34:0-7,10.0.0.2/ef56ab78:8-15", "nodes": "2"}``; the key is the
        pool's name (the roles it runs are in ``describe()``).
        """
        return placement_record({p.name: p.rank_nodes for p in self.pools}, self.nodes)


def _span(ranks: range) -> str:
    return str(ranks.start) if len(ranks) == 1 else f"{ranks.start}-{ranks.stop - 1}"


def placement_record(rank_nodes: dict[str, Sequence[str]], nodes: Sequence[NodeInfo]) -> dict[str, str]:
    """``{"placement.<pool>": "ip/node:0-7,...", "nodes": "N"}`` from each pool's node id per rank (rank 0 first).

    ``nodes`` names the node ids (their labels); an id not among them is shown by its first 8 characters.
    """
    labels = {node.node_id: node.label for node in nodes}
    record = {}
    for pool, ids in rank_nodes.items():
        spans = []
        for node_id in dict.fromkeys(ids):
            ranks = [r for r, n in enumerate(ids) if n == node_id]
            spans.append(f"{labels.get(node_id, node_id[:8])}:{_span(range(ranks[0], ranks[-1] + 1))}")
        record[f"placement.{pool}"] = ",".join(spans)
    record["nodes"] = str(len({n for ids in rank_nodes.values() for n in ids}))
    return record


def format_resources(resources: dict[str, float]) -> str:
    """``{CPU: 1, GPU: 8}``: sorted, whole numbers without a decimal point."""
    shown = {k: (int(v) if float(v).is_integer() else round(v, 3)) for k, v in sorted(resources.items())}
    return "{" + ", ".join(f"{k}: {v}" for k, v in shown.items()) + "}"


def _capacity(free: dict[str, float], bundle: dict[str, float]) -> int:
    """How many ``bundle`` fit in ``free``."""
    counts = [math.floor((free.get(k, 0.0) + _EPS) / v) for k, v in bundle.items() if v > 0]
    return min(counts) if counts else 0


def _order(nodes: Sequence[NodeInfo]) -> list[NodeInfo]:
    """The cluster's order: the driver's node first, then by IP address and node id."""
    return sorted(nodes, key=lambda n: (not n.is_driver, n.ip, n.node_id))


def plan_placement(requests: Sequence[PoolRequest], nodes: Sequence[NodeInfo]) -> PlacementPlan:
    """Place every request on ``nodes`` (see the module docstring for the rules); raises :class:`PlacementError`."""
    ordered = _order(nodes)
    free = {n.node_id: dict(n.resources) for n in ordered}
    used: set[str] = set()
    plan = PlacementPlan()
    for request in requests:
        placed = _place_one(request, ordered, free, used, plan)
        for node in placed.nodes:
            for key, value in request.bundle.items():
                free[node.node_id][key] = free[node.node_id].get(key, 0.0) - value * placed.per_node
            used.add(node.node_id)
        plan.pools.append(placed)
    return plan


def _place_one(
    request: PoolRequest,
    ordered: list[NodeInfo],
    free: dict[str, dict[str, float]],
    used: set[str],
    plan: PlacementPlan,
) -> PoolPlacement:
    n = request.n_workers
    shapes = [request.nnodes] if request.nnodes is not None else [k for k in range(1, n + 1) if n % k == 0]
    shapes = [k for k in shapes if (n // k) % request.group_size == 0]
    for nnodes in shapes:
        per_node = n // nnodes
        fitting = [node for node in ordered if _capacity(free[node.node_id], request.bundle) >= per_node]
        if len(fitting) >= nnodes:
            fitting.sort(
                key=lambda node: node.node_id in used
            )  # stable: unused nodes first, cluster order kept
            chosen = sorted(fitting[:nnodes], key=ordered.index)
            return PoolPlacement(
                request.name, request.roles or (request.name,), dict(request.bundle), tuple(chosen), per_node
            )
    raise PlacementError(_refusal(request, ordered, free, plan))


def _refusal(
    request: PoolRequest, ordered: list[NodeInfo], free: dict[str, dict[str, float]], plan: PlacementPlan
) -> str:
    """One sentence: what the pool asked, what each node has free (and after which pools)."""
    n, bundle = request.n_workers, request.bundle
    if request.nnodes is None:
        asked = f"{n} workers of {format_resources(bundle)} on as few nodes as hold them"
    else:
        asked = (
            f"{n} workers of {format_resources(bundle)} on {request.nnodes} node(s), "
            f"{n // request.nnodes} per node"
        )
    if request.group_size > 1:
        asked += f" in groups of {request.group_size} inside a node"
    per_node = ", ".join(
        f"{node.label} {format_resources({k: max(0.0, free[node.node_id].get(k, 0.0)) for k in bundle})}"
        for node in ordered
    )
    after = f" after {', '.join(p.name for p in plan.pools)}" if plan.pools else ""
    return (
        f"the {request.name!r} pool asked for {asked}, but the cluster's {len(ordered)} node(s) have free{after}: "
        f"{per_node or 'nothing'}"
    )


def cluster_nodes() -> list[NodeInfo]:
    """The alive nodes of the Ray cluster this process is connected to (resources without memory)."""
    import ray

    driver = ray.get_runtime_context().get_node_id()
    nodes = []
    for node in ray.nodes():
        if not node.get("Alive", node.get("alive", False)):
            continue
        resources = {
            k: float(v)
            for k, v in node["Resources"].items()
            if k not in ("memory", "object_store_memory") and not k.startswith("node:")
        }
        nodes.append(
            NodeInfo(
                str(node["NodeID"]),
                str(node.get("NodeManagerAddress", "?")),
                resources,
                node["NodeID"] == driver,
            )
        )
    return nodes


def never_fits(request: PoolRequest, nodes: Sequence[NodeInfo]) -> bool:
    """Whether no node of this kind, even idle, holds one node's share of ``request`` (more such nodes would not help)."""
    smallest = request.n_workers // request.nnodes if request.nnodes is not None else request.group_size
    return all(_capacity(node.resources, request.bundle) < smallest for node in nodes)


def describe_node(node_id: str) -> str:
    """``node 10.0.0.2/ab12cd34`` for a node of the connected cluster, noting when it is no longer alive."""
    import ray

    try:
        found = next((n for n in ray.nodes() if n.get("NodeID") == node_id), None)
    except Exception:  # Ray itself is going down: say what is known
        found = None
    if found is None:
        return f"node {node_id[:8]}"
    label = f"node {found.get('NodeManagerAddress', '?')}/{node_id[:8]}"
    alive = found.get("Alive", found.get("alive", True))
    return label if alive else f"{label} (that node left the cluster)"


def describe_nodes(nodes: Sequence[NodeInfo]) -> list[dict[str, Any]]:
    """The nodes as JSON-able rows (``verity diagnose --ray``)."""
    return [
        {"node": n.label, "node_id": n.node_id, "ip": n.ip, "driver": n.is_driver, "resources": n.resources}
        for n in _order(nodes)
    ]
