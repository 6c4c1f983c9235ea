"""A rank that dies in a collective is named as the cause, not its peer's 'Connection reset by peer'.

Rank 1 kills itself; rank 0 waits until that process is gone, then its gloo all_reduce fails at
once. Rank 0's error usually reaches the driver before Ray has noticed the death, yet the group
call must report ``WorkerDiedError`` for rank 1, with rank 0's error as a consequence.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import ray
import ray.cloudpickle
import torch
from verity.controller import (
    Dispatch,
    ResourcePool,
    Worker,
    WorkerDiedError,
    WorkerGroup,
    WorkerMethodError,
    init_ray,
    register,
    shutdown_ray,
)
from verity.controller.rank_failures import explain_failure

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class CollectiveWorker(Worker):
    @register(Dispatch.BROADCAST)
    def join(self) -> None:
        self.init_process_group("gloo", timeout_s=120)

    @register(Dispatch.BROADCAST)
    def all_reduce_after_rank_one_dies(self, pid_file: str) -> float:
        import torch.distributed as dist

        if self.rank == 1:
            Path(pid_file).write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        while not Path(pid_file).is_file() or _alive(int(Path(pid_file).read_text() or 0)):
            time.sleep(0.01)
        value = torch.ones(4)
        dist.all_reduce(value)  # rank 0: rank 1 is gone, so this fails at once ("Connection reset by peer")
        return float(value.sum())

    @register(Dispatch.BROADCAST)
    def fail_on_rank_zero(self) -> int:
        if self.rank == 0:
            raise ValueError("rank zero refuses")
        time.sleep(0.2)
        return self.rank


@pytest.fixture(scope="module")
def cluster():
    if ray.is_initialized():
        ray.shutdown()
    init_ray(num_cpus=2, object_store_memory=100 * 1024**2)
    yield
    shutdown_ray()


@pytest.fixture
def group(cluster):
    pool = ResourcePool([2], cpus_per_bundle=0.5, name="dead-rank", timeout_s=60)
    wg = WorkerGroup(pool, CollectiveWorker)
    try:
        yield wg
    finally:
        wg.shutdown()
        pool.remove()


def test_dead_rank_is_the_cause_and_survivor_errors_are_consequences(group, tmp_path):
    group.join()
    with pytest.raises(WorkerMethodError, match="failed on rank 0: ValueError: rank zero refuses"):
        group.fail_on_rank_zero()  # a plain method error, every rank alive: reported as before
    with pytest.raises(WorkerDiedError) as caught:
        group.all_reduce_after_rank_one_dies(str(tmp_path / "rank1.pid"))
    assert caught.value.rank == 1 and "rank 1 died" in str(caught.value), str(caught.value)


@ray.remote
def _collective_fails() -> None:
    raise RuntimeError("[gloo] Connection reset by peer")


@ray.remote
class _Rank:
    def ping(self) -> int:
        return os.getpid()


def test_a_death_ray_reports_after_the_survivor_error_is_still_the_cause(cluster):
    """The order a loaded machine produces: rank 0's error first, Ray's notice of rank 1's death later."""
    ranks = [_Rank.remote(), _Rank.remote()]
    ray.get([r.ping.remote() for r in ranks])
    ray.kill(ranks[1])
    survivor = _collective_fails.remote()
    with pytest.raises(ray.exceptions.RayTaskError) as first:
        ray.get(survivor)
    error = explain_failure(
        label="actor.update_actor",
        where={"group": "actor", "role": "worker", "method": "update_actor"},
        rank=0,
        error=first.value,
        pending=[],
        rank_of={survivor: 0},
        ping=lambda r: ranks[r].ping.remote(),
        world_size=2,
    )
    assert isinstance(error, WorkerDiedError) and error.rank == 1, str(error)
    assert "rank 1 died" in str(error)
    assert "rank 0: RuntimeError: [gloo] Connection reset by peer" in str(error)  # named as a consequence
    alive = explain_failure(
        label="actor.update_actor",
        where={"group": "actor", "role": "worker", "method": "update_actor"},
        rank=0,
        error=first.value,
        pending=[],
        rank_of={survivor: 0},
        ping=lambda r: ranks[0].ping.remote(),  # every rank answers: the first error stands
        world_size=2,
    )
    assert isinstance(alive, WorkerMethodError) and "failed on rank 0" in str(alive)
