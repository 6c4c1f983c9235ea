"""Resource pools: reserved slots (Ray placement-group bundles) that worker groups run in.

``ResourcePool([4, 4], resource="GPU")`` reserves two placement groups of four bundles,
each bundle one GPU plus ``cpus_per_bundle`` CPUs; each placement group is packed onto
one node (``STRICT_PACK``). Slot ``i`` (rank ``i`` of a group built on the pool) is bundle
``i - offset`` of the placement group it falls in, so ranks are ordered node by node.

Where each placement group goes is Ray's choice unless ``node_ids`` names a node for each:
then every bundle carries Ray's ``ray.io/node-id`` label selector and lands exactly there.
A run passes the nodes of its :class:`~verity.controller.placement.PlacementPlan`
(:meth:`ResourcePool.from_plan`), so what is reserved is what was planned and printed.

Creating a pool first checks the request against the cluster's total resources and
fails at once when it can never fit; otherwise it waits up to ``timeout_s`` for the
reservation and fails with the asked and available resources, never hanging.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence
from typing import Any

from verity.controller.errors import ResourceUnavailableError
from verity.controller.placement import PoolPlacement
from verity.controller.placement import format_resources as _fmt

__all__ = ["ResourcePool"]

STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
#: the label every Ray node carries with its own id (placement-group bundles select on it)
NODE_ID_LABEL = "ray.io/node-id"
_pool_ids = itertools.count()


def _cluster_nodes() -> list[dict[str, float]]:
    """Total resources of each alive node (only CPU/GPU/custom counts, not memory)."""
    import ray

    nodes = []
    for node in ray.nodes():
        if not node.get("Alive", node.get("alive", False)):
            continue
        nodes.append(
            {k: v for k, v in node["Resources"].items() if k not in ("memory", "object_store_memory")}
        )
    return nodes


class ResourcePool:
    """Slots reserved on a Ray cluster; one placement group per entry of ``bundles_per_node``.

    Args:
        bundles_per_node: bundles (= worker slots) per placement group, e.g. ``[8, 8]``.
        resource: Ray resource of one slot: ``"CPU"``, ``"GPU"``, ``"NPU"``, ...
        cpus_per_bundle: CPUs reserved per slot (fractions allowed, e.g. 0.5 on small machines).
        name: used in error messages (default ``pool<N>``).
        strategy: Ray placement strategy of each placement group (default ``STRICT_PACK``:
            all bundles of an entry on one node).
        timeout_s: seconds to wait for the reservation before raising.
        node_ids: the Ray node id each placement group must land on (one per entry of
            ``bundles_per_node``); ``None``: Ray chooses.
    """

    def __init__(
        self,
        bundles_per_node: Sequence[int],
        resource: str = "CPU",
        cpus_per_bundle: float = 1.0,
        name: str | None = None,
        strategy: str = "STRICT_PACK",
        timeout_s: float = 60.0,
        node_ids: Sequence[str] | None = None,
    ) -> None:
        import ray
        from ray.util.placement_group import placement_group

        self.name = name or f"pool{next(_pool_ids)}"
        counts = list(bundles_per_node) if isinstance(bundles_per_node, list | tuple) else None
        if not counts or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in counts):
            raise ValueError(
                f"ResourcePool {self.name!r}: bundles_per_node must be a non-empty list of ints >= 1, "
                f"got {bundles_per_node!r}"
            )
        if not isinstance(resource, str) or not resource:
            raise ValueError(
                f"ResourcePool {self.name!r}: resource must be a resource name like 'CPU', got {resource!r}"
            )
        if cpus_per_bundle < 0 or (resource == "CPU" and cpus_per_bundle <= 0):
            raise ValueError(
                f"ResourcePool {self.name!r}: cpus_per_bundle must be > 0 for CPU slots, got {cpus_per_bundle}"
            )
        if strategy not in STRATEGIES:
            raise ValueError(
                f"ResourcePool {self.name!r}: strategy must be one of {STRATEGIES}, got {strategy!r}"
            )
        if node_ids is not None and len(node_ids) != len(counts):
            raise ValueError(
                f"ResourcePool {self.name!r}: node_ids names {len(node_ids)} node(s) for {len(counts)} placement groups"
            )
        if not ray.is_initialized():
            raise RuntimeError(
                f"ResourcePool {self.name!r}: Ray is not running; call verity.controller.init_ray() first"
            )

        self.bundles_per_node = counts
        self.resource = resource
        self.cpus_per_bundle = float(cpus_per_bundle)
        self.strategy = strategy
        bundle: dict[str, float] = {"CPU": self.cpus_per_bundle} if self.cpus_per_bundle else {}
        if resource != "CPU":
            bundle[resource] = 1.0
        self.bundle = bundle
        self.node_ids = list(node_ids) if node_ids is not None else None
        self._check_feasible()

        if self.node_ids is None:
            self.placement_groups = [
                placement_group([dict(bundle) for _ in range(n)], strategy=strategy) for n in counts
            ]
        else:
            self.placement_groups = [
                placement_group(
                    [dict(bundle) for _ in range(n)],
                    strategy=strategy,
                    bundle_label_selector=[{NODE_ID_LABEL: node}] * n,
                )
                for n, node in zip(counts, self.node_ids, strict=True)
            ]
        try:
            ray.get([pg.ready() for pg in self.placement_groups], timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.remove()
            raise ResourceUnavailableError(
                f"{self._request_text()}: not reserved within {timeout_s:g} s; the cluster has "
                f"{self._relevant(ray.cluster_resources())} in total and "
                f"{self._relevant(ray.available_resources())} free now "
                "(other pools or groups hold the rest?)"
                + (f"; its placement groups are pinned to nodes {self.node_ids}" if self.node_ids else "")
            ) from None
        self.slots = [(pg, i) for pg, n in zip(self.placement_groups, counts, strict=True) for i in range(n)]
        self.slot_node_ids = self._node_ids()

    @classmethod
    def from_plan(
        cls,
        placed: PoolPlacement,
        resource: str = "CPU",
        cpus_per_bundle: float = 1.0,
        timeout_s: float = 60.0,
    ) -> ResourcePool:
        """The pool of one planned :class:`~verity.controller.placement.PoolPlacement`: a placement group per node, pinned."""
        return cls(
            [placed.per_node] * len(placed.nodes),
            resource=resource,
            cpus_per_bundle=cpus_per_bundle,
            name=placed.name,
            timeout_s=timeout_s,
            node_ids=[node.node_id for node in placed.nodes],
        )

    # ------------------------------------------------------------------ info
    @property
    def world_size(self) -> int:
        """Number of slots (= ranks of a group built on this pool)."""
        return sum(self.bundles_per_node)

    def actor_options(self) -> dict[str, Any]:
        """Ray actor options that make one actor use exactly one slot's resources."""
        options: dict[str, Any] = {"num_cpus": self.cpus_per_bundle}
        if self.resource == "GPU":
            options["num_gpus"] = 1
        elif self.resource != "CPU":
            options["resources"] = {self.resource: 1.0}
        return options

    def _relevant(self, resources: dict[str, float]) -> str:
        """Only the resource kinds a bundle asks for (Ray adds many per-placement-group entries)."""
        return _fmt({k: resources.get(k, 0.0) for k in self.bundle})

    def _request_text(self) -> str:
        total: dict[str, float] = {}
        for key, value in self.bundle.items():
            total[key] = value * self.world_size
        return (
            f"ResourcePool {self.name!r} asked for {self.bundles_per_node} bundles of {_fmt(self.bundle)} "
            f"({_fmt(total)} in all, strategy {self.strategy})"
        )

    def _check_feasible(self) -> None:
        """Fail at once when the request cannot fit the cluster even when it is idle."""
        nodes = _cluster_nodes()
        totals: dict[str, float] = {}
        for node in nodes:
            for key, value in node.items():
                totals[key] = totals.get(key, 0.0) + value
        short = {
            k: v * self.world_size
            for k, v in self.bundle.items()
            if v * self.world_size > totals.get(k, 0.0) + 1e-9
        }
        if short:
            raise ResourceUnavailableError(
                f"{self._request_text()}, but the whole cluster has only {_fmt({k: totals.get(k, 0.0) for k in self.bundle})} "
                f"({len(nodes)} node(s))"
            )
        if self.strategy == "STRICT_PACK" and self.node_ids is None:
            largest = max(self.bundles_per_node)
            fits = [
                node
                for node in nodes
                if all(node.get(k, 0.0) + 1e-9 >= v * largest for k, v in self.bundle.items())
            ]
            if not fits:
                per_node = [_fmt({k: n.get(k, 0.0) for k in self.bundle}) for n in nodes]
                raise ResourceUnavailableError(
                    f"{self._request_text()}: {largest} bundles must fit on one node, but the nodes have {per_node}"
                )
        if self.strategy == "STRICT_SPREAD":
            largest = max(self.bundles_per_node)
            fits = [
                node for node in nodes if all(node.get(k, 0.0) + 1e-9 >= v for k, v in self.bundle.items())
            ]
            if len(fits) < largest:
                raise ResourceUnavailableError(
                    f"{self._request_text()}: STRICT_SPREAD needs {largest} distinct nodes, the cluster has {len(fits)} that fit a bundle"
                )

    def _node_ids(self) -> list[str]:
        from ray.util.placement_group import placement_group_table

        ids = []
        for pg, index in self.slots:
            table = placement_group_table(pg)
            ids.append(str(table["bundles_to_node_id"][index]))
        return ids

    # ------------------------------------------------------------------ lifetime
    def remove(self) -> None:
        """Release the reservation (groups still running in it lose their slots)."""
        from ray.util.placement_group import remove_placement_group

        for pg in getattr(self, "placement_groups", []):
            with contextlib.suppress(Exception):  # already removed, or Ray shut down
                remove_placement_group(pg)
        self.placement_groups = []

    def __enter__(self) -> ResourcePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"ResourcePool(name={self.name!r}, bundles_per_node={self.bundles_per_node}, bundle={_fmt(self.bundle)})"
