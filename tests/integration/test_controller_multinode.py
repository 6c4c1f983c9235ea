"""A two-node cluster simulated with ray.cluster_utils.Cluster: one group across both nodes."""

from __future__ import annotations

import os
import sys

import pytest
import ray
import ray.cloudpickle
import torch
from helpers.sim_cluster import simulated_cluster
from verity.controller import (
    Dispatch,
    ResourcePool,
    ResourceUnavailableError,
    Worker,
    WorkerGroup,
    register,
)

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class NodeWorker(Worker):
    @register(Dispatch.BROADCAST)
    def where(self) -> dict:
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "rank": self.rank,
            "local_rank": self.local_rank,
            "node_rank": int(os.environ["NODE_RANK"]),
        }

    @register(Dispatch.BROADCAST)
    def all_reduce_rank(self) -> float:
        import torch.distributed as dist

        self.init_process_group("gloo", timeout_s=60)
        value = torch.tensor([float(self.rank)])
        dist.all_reduce(value)
        return value.item()


@pytest.fixture(scope="module")
def two_nodes():
    with simulated_cluster(head={"num_cpus": 2}, nodes=[{"num_cpus": 2}]) as cluster:
        yield cluster


def test_one_group_spans_both_nodes(two_nodes):
    # each entry is packed onto one node; 2 CPUs per node force one entry per node
    with ResourcePool([2, 2], cpus_per_bundle=1, name="two_nodes", timeout_s=60) as pool:
        assert len(set(pool.slot_node_ids)) == 2
        wg = WorkerGroup(pool, NodeWorker)
        try:
            where = wg.where()
            nodes = [w["node_id"] for w in where]
            assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2]
            assert nodes == pool.slot_node_ids
            assert [w["local_rank"] for w in where] == [0, 1, 0, 1]
            assert [w["node_rank"] for w in where] == [0, 0, 1, 1]
            assert wg.all_reduce_rank() == [6.0] * 4  # 0 + 1 + 2 + 3
        finally:
            wg.shutdown()


def test_bundles_that_fit_no_single_node(two_nodes):
    # 4 CPUs in the cluster, but 3 bundles packed onto one node need 3 on one node
    with pytest.raises(ResourceUnavailableError, match="3 bundles must fit on one node, but the nodes have"):
        ResourcePool([3], cpus_per_bundle=1, name="wide")
    with pytest.raises(ResourceUnavailableError, match="STRICT_SPREAD needs 3 distinct nodes"):
        ResourcePool([3], cpus_per_bundle=0.5, name="spread", strategy="STRICT_SPREAD")
