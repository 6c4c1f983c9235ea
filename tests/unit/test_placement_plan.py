"""Placement plans without Ray: bundle -> node -> rank for clusters a laptop cannot hold (4 nodes x 8 GPUs)."""

from __future__ import annotations

import pytest
from verity.controller.placement import NodeInfo, PlacementError, PoolRequest, never_fits, plan_placement

GPU = {"CPU": 1.0, "GPU": 1.0}


def gpu_nodes(n: int, gpus: int = 8, cpus: int = 64) -> list[NodeInfo]:
    # ids chosen so that sorting by id differs from the list order: the driver's node must still come first
    return [
        NodeInfo(
            f"node{9 - i}", f"10.0.0.{i + 1}", {"CPU": float(cpus), "GPU": float(gpus)}, is_driver=i == 0
        )
        for i in range(n)
    ]


def test_colocated_run_on_four_nodes_orders_ranks_node_by_node():
    nodes = gpu_nodes(4)
    plan = plan_placement([PoolRequest("actor", 32, GPU, nnodes=4, roles=("actor", "reference"))], nodes)
    actor = plan.pool("actor")
    assert actor.per_node == 8
    assert [n.ip for n in actor.nodes] == ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"]
    expected = [node.node_id for node in nodes for _ in range(8)]
    assert actor.rank_nodes == expected  # rank r on node r // 8
    lines = plan.describe().splitlines()
    assert lines[0].startswith("actor+reference  node 10.0.0.1/node9  ranks 0-7")
    assert lines[3].startswith("actor+reference  node 10.0.0.4/node6  ranks 24-31")
    assert plan.as_record() == {
        "placement.actor": "10.0.0.1/node9:0-7,10.0.0.2/node8:8-15,10.0.0.3/node7:16-23,10.0.0.4/node6:24-31",
        "nodes": "4",
    }


def test_rollout_split_onto_two_nodes_and_critic_apart():
    nodes = gpu_nodes(4)
    plan = plan_placement(
        [
            PoolRequest("actor", 8, GPU, nnodes=1),
            PoolRequest("rollout", 16, GPU, nnodes=2),
            PoolRequest("critic", 8, GPU),
        ],
        nodes,
    )
    actor, rollout, critic = (plan.pool(n) for n in ("actor", "rollout", "critic"))
    assert [n.ip for n in actor.nodes] == ["10.0.0.1"]
    assert [n.ip for n in rollout.nodes] == ["10.0.0.2", "10.0.0.3"]
    assert rollout.rank_nodes == [nodes[1].node_id] * 8 + [nodes[2].node_id] * 8
    assert [n.ip for n in critic.nodes] == ["10.0.0.4"]  # nnodes unset: the fewest nodes, an unused one
    assert len(plan.nodes) == 4


def test_a_pool_takes_what_earlier_pools_left():
    nodes = gpu_nodes(2)
    plan = plan_placement(
        [PoolRequest("actor", 12, GPU, nnodes=2), PoolRequest("critic", 4, GPU, nnodes=2)], nodes
    )
    assert plan.pool("actor").per_node == 6
    assert plan.pool("critic").per_node == 2  # 2 GPUs left on each node
    with pytest.raises(PlacementError, match=r"the 'critic' pool asked for 6 workers .* after actor"):
        plan_placement(
            [PoolRequest("actor", 12, GPU, nnodes=2), PoolRequest("critic", 6, GPU, nnodes=2)], nodes
        )


def test_unset_nnodes_takes_the_fewest_nodes_that_hold_the_workers():
    plan = plan_placement([PoolRequest("actor", 16, GPU)], gpu_nodes(4))
    assert plan.pool("actor").per_node == 8 and len(plan.pool("actor").nodes) == 2
    cpu_nodes = [NodeInfo(f"n{i}", "127.0.0.1", {"CPU": 1.0}, is_driver=i == 0) for i in range(2)]
    plan = plan_placement([PoolRequest("actor", 2, {"CPU": 1.0})], cpu_nodes)
    assert plan.pool("actor").per_node == 1 and len(plan.pool("actor").nodes) == 2


def test_model_parallel_groups_stay_inside_a_node():
    nodes = [NodeInfo(f"n{i}", f"10.0.0.{i}", {"CPU": 8.0, "GPU": 3.0}) for i in range(4)]
    # 6 workers in TP groups of 2: 3 per node would split a group, so 2 per node on 3 nodes
    plan = plan_placement([PoolRequest("actor", 6, GPU, group_size=2)], nodes)
    assert plan.pool("actor").per_node == 2 and len(plan.pool("actor").nodes) == 3
    with pytest.raises(PlacementError, match="in groups of 4 inside a node"):
        plan_placement([PoolRequest("actor", 8, GPU, group_size=4)], nodes)


def test_refusal_is_one_sentence_naming_the_ask_and_each_node():
    nodes = gpu_nodes(2)
    with pytest.raises(PlacementError) as caught:
        plan_placement([PoolRequest("actor", 24, GPU, nnodes=3)], nodes)
    message = str(caught.value)
    assert "\n" not in message
    assert "'actor' pool asked for 24 workers of {CPU: 1, GPU: 1} on 3 node(s), 8 per node" in message
    assert "10.0.0.1/node9 {CPU: 64, GPU: 8}" in message and "10.0.0.2/node8 {CPU: 64, GPU: 8}" in message


def test_never_fits_tells_a_hopeless_shape_from_a_missing_node():
    nodes = gpu_nodes(1)
    assert never_fits(PoolRequest("actor", 16, GPU, nnodes=1), nodes)  # 16 GPUs on one 8-GPU node
    assert not never_fits(PoolRequest("actor", 16, GPU, nnodes=2), nodes)  # a second node would do
    assert never_fits(PoolRequest("actor", 1, {"CPU": 1.0, "NPU": 1.0}), nodes)


def test_bad_requests_are_refused_before_planning():
    with pytest.raises(ValueError, match="3 workers do not divide over nnodes = 2"):
        PoolRequest("actor", 3, GPU, nnodes=2)
    with pytest.raises(ValueError, match="n_workers must be >= 1"):
        PoolRequest("actor", 0, GPU)
