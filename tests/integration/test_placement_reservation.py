"""A plan for 4 nodes x 8 GPUs reserved on a simulated cluster (GPUs declared, nothing computes):
every bundle lands on the node the plan named, ranks node by node."""

from __future__ import annotations

import pytest
from helpers.sim_cluster import simulated_cluster
from verity.controller import ResourcePool
from verity.controller.placement import PoolRequest, cluster_nodes, plan_placement

GPU = {"CPU": 0.5, "GPU": 1.0}


@pytest.fixture(scope="module")
def four_gpu_nodes():
    with simulated_cluster(head={"num_cpus": 1}, nodes=[{"num_cpus": 8, "num_gpus": 8}] * 4) as cluster:
        yield cluster


def _reserve(plan) -> list[ResourcePool]:
    return [ResourcePool.from_plan(p, resource="GPU", cpus_per_bundle=0.5, timeout_s=60) for p in plan.pools]


def _check(plan, pools) -> None:
    from ray.util.placement_group import placement_group_table

    for placed, pool in zip(plan.pools, pools, strict=True):
        assert pool.slot_node_ids == placed.rank_nodes, placed.name  # rank -> node as planned
        for pg, node in zip(pool.placement_groups, placed.nodes, strict=True):  # bundle -> node
            assert set(placement_group_table(pg)["bundles_to_node_id"].values()) == {node.node_id}


@pytest.mark.parametrize(
    "requests",
    [
        pytest.param(
            [PoolRequest("actor", 32, GPU, nnodes=4, roles=("actor", "reference", "critic"))], id="colocated"
        ),
        pytest.param(
            [
                PoolRequest("actor", 16, GPU, nnodes=2),
                PoolRequest("rollout", 16, GPU, nnodes=2),
            ],
            id="rollout-on-two-nodes",
        ),
        pytest.param(
            [PoolRequest("actor", 24, GPU, nnodes=3), PoolRequest("critic", 8, GPU)],
            id="critic-apart",
        ),
    ],
)
def test_the_reservation_is_the_plan(four_gpu_nodes, requests):
    nodes = cluster_nodes()
    plan = plan_placement(requests, nodes)
    assert len({n.node_id for n in plan.nodes}) == 4  # every layout here fills the four GPU nodes
    pools = _reserve(plan)
    try:
        _check(plan, pools)
        if len(plan.pools) > 1:  # separate pools never share a node when the cluster has room
            used = [set(p.rank_nodes) for p in plan.pools]
            assert not set.intersection(*used)
    finally:
        for pool in pools:
            pool.remove()
