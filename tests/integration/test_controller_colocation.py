"""Colocated roles in one process, roles split across pools, and a worker that dies."""

from __future__ import annotations

import os
import sys

import pytest
import ray
import ray.cloudpickle
import torch
from verity.batch import Batch
from verity.controller import (
    Dispatch,
    ResourcePool,
    Worker,
    WorkerDiedError,
    WorkerGroup,
    WorkerMethodError,
    colocate,
    init_ray,
    register,
    role,
    shutdown_ray,
)

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class ActorRole(Worker):
    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.weights = torch.zeros(4)

    @register(Dispatch.BROADCAST)
    def pid(self) -> int:
        return os.getpid()

    @register(Dispatch.BROADCAST)
    def fill_weights(self, value: float) -> int:
        self.weights.fill_(value)
        return self.weights.data_ptr()

    @register(Dispatch.DP_SPLIT)
    def scale_scores(self, batch: Batch) -> Batch:
        return Batch.from_dict({"scores": batch["scores"] * self.scale})


class RefRole(Worker):
    @register(Dispatch.BROADCAST)
    def pid(self) -> int:
        return os.getpid()

    @register(Dispatch.BROADCAST)
    def read_actor_weights(self) -> tuple[int, list[float]]:
        """The actor role's tensor, reached in-process (no copy, same memory)."""
        weights = self.peer("actor").weights
        return weights.data_ptr(), weights.tolist()

    @register(Dispatch.DP_SPLIT)
    def offset_scores(self, batch: Batch) -> Batch:
        return Batch.from_dict({"scores": batch["scores"] + 1000 * self.rank})


class Fragile(Worker):
    @register(Dispatch.RANK_ZERO)
    def crash(self) -> None:
        os._exit(3)

    @register(Dispatch.BROADCAST)
    def ping(self) -> str:
        return "pong"


@pytest.fixture(scope="module")
def cluster():
    if ray.is_initialized():
        ray.shutdown()
    init_ray(num_cpus=4, object_store_memory=200 * 1024**2)
    yield
    shutdown_ray()


def test_colocated_roles_share_one_process(cluster):
    with ResourcePool([2], cpus_per_bundle=0.5, name="colocated") as pool:
        wg = WorkerGroup(pool, colocate({"actor": role(ActorRole, 2.0), "ref": RefRole}))
        try:
            actor_pids, ref_pids = wg.actor.pid(), wg.ref.pid()
            assert actor_pids == ref_pids  # rank i of both roles is the same process
            assert len(set(actor_pids)) == 2  # two ranks, two processes
            pointers = wg.actor.fill_weights(3.0)
            seen = wg.ref.read_actor_weights()
            assert [p for p, _ in seen] == pointers
            assert [w for _, w in seen] == [[3.0] * 4] * 2
            out = wg.actor.scale_scores(Batch.from_dict({"scores": torch.arange(5.0)}))
            assert out["scores"].tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]
            assert wg.execute_all("ref.pid") == ref_pids
            assert wg.roles == ["actor", "ref"]
            with pytest.raises(ValueError, match="colocated; name the role as 'role.method'"):
                wg.execute_all("pid")
        finally:
            wg.shutdown()


def test_roles_split_across_pools(cluster):
    with (
        ResourcePool([2], cpus_per_bundle=0.5, name="actor_pool") as actor_pool,
        ResourcePool([1], cpus_per_bundle=0.5, name="ref_pool") as ref_pool,
    ):
        actor = WorkerGroup(actor_pool, ActorRole, 10.0)
        ref = WorkerGroup(ref_pool, RefRole)
        try:
            assert not set(actor.pid()) & set(ref.pid())
            b = Batch.from_dict({"scores": torch.arange(3.0)})
            assert actor.scale_scores(b)["scores"].tolist() == [0.0, 10.0, 20.0]
            assert ref.offset_scores(b)["scores"].tolist() == [0.0, 1.0, 2.0]
            with pytest.raises(
                WorkerMethodError, match="RefRole.read_actor_weights failed on rank 0: KeyError"
            ):
                ref.read_actor_weights()  # no actor role in the ref group's process
        finally:
            actor.shutdown()
            ref.shutdown()


def test_bad_group_definitions_fail_before_starting_workers(cluster):
    with ResourcePool([1], cpus_per_bundle=0.5, name="tiny") as pool:
        with pytest.raises(ValueError, match="role name 'shutdown' clashes"):
            WorkerGroup(pool, colocate({"shutdown": RefRole}))
        with pytest.raises(TypeError, match="must be a subclass of verity.controller.Worker"):
            WorkerGroup(pool, dict)
        with pytest.raises(ValueError, match="must be an identifier"):
            colocate({"not-a-name": RefRole})


def test_dead_worker_is_reported_not_waited_for(cluster):
    with ResourcePool([1], cpus_per_bundle=0.5, name="fragile") as pool:
        wg = WorkerGroup(pool, Fragile)
        try:
            assert wg.ping() == ["pong"]
            with pytest.raises(WorkerDiedError) as err:
                wg.crash()
            assert err.value.rank == 0 and err.value.method == "crash"
            assert "Fragile.crash: the worker process of rank 0 died" in str(err.value)
            with pytest.raises(WorkerDiedError, match="Fragile.ping: the worker process of rank 0 died"):
                wg.ping()
        finally:
            wg.shutdown()
