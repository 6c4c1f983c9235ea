"""A 4-rank worker group on a private local Ray cluster: dispatch modes, gloo, errors, resources."""

from __future__ import annotations

import os
import sys

import pytest
import ray
import ray.cloudpickle
import torch
from verity.batch import Batch, BatchSchemaError
from verity.controller import (
    Collect,
    Dispatch,
    DispatchError,
    ResourcePool,
    ResourceUnavailableError,
    Worker,
    WorkerGroup,
    WorkerMethodError,
    init_ray,
    register,
    shutdown_ray,
)

# Worker classes defined here travel to the Ray workers by value (this file is not importable there).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

CLUSTER_CPUS = 4
WORKER_CPUS = 0.5  # the 4-rank group holds 2 of the 4 logical CPUs


class ShardWorker(Worker):
    @register(Dispatch.DP_SPLIT)
    def tag_rows(self, batch: Batch) -> Batch:
        """Echo scores and uid, and tag each row with the rank that processed it (group)."""
        group = torch.full((len(batch),), self.rank, dtype=torch.long)
        return Batch.from_dict({"scores": batch["scores"].clone(), "group": group}, {"uid": batch["uid"]})

    @register(Dispatch.DP_SPLIT)
    def generate_resident(self, batch: Batch) -> Batch:
        """Rows as a rollout answers them: the prompt side kept in this rank's object store."""
        from verity.batch import keep_resident

        rows = len(batch)
        ids = torch.arange(rows * 64).view(rows, 64) + 1000 * self.rank
        out = Batch.from_dict(
            {
                "input_ids": ids,
                "attention_mask": torch.ones(rows, 64, dtype=torch.long),
                "responses": ids[:, -2:].clone(),
                "scores": batch["scores"].clone(),
            }
        )
        return keep_resident(out, pad_token_id=0)

    @register(Dispatch.DP_SPLIT)
    def sum_ids(self, batch: Batch) -> torch.Tensor:
        """``[b]`` each row's ``input_ids`` summed (the rows arrive whole)."""
        return batch["input_ids"].sum(-1)

    @register(Dispatch.DP_SPLIT, collect=Collect.RANK_ZERO)
    def big_answer_rank_zero_reads(self, batch: Batch) -> torch.Tensor:
        """A large answer from every rank, of which the driver reads rank 0's (as update metrics)."""
        return torch.full((10_000,), self.rank)

    @register(Dispatch.DP_SPLIT)
    def sample_twice(self, batch: Batch) -> Batch:
        """Two answers per input row (as n samples per prompt), built from scratch."""
        return Batch.from_dict({"scores": batch["scores"].repeat_interleave(2)})

    @register(Dispatch.DP_SPLIT)
    def fail_on_rank_two(self, batch: Batch) -> Batch:
        if self.rank == 2:
            raise ValueError("rank two refuses this batch")
        return batch

    @register(Dispatch.BROADCAST)
    def environment(self) -> dict:
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        return {"pid": os.getpid(), "rank": self.rank, **{k: os.environ[k] for k in keys}}

    @register(Dispatch.BROADCAST)
    def all_reduce_sum(self) -> list[float]:
        """Sum over ranks of [rank + 1, 1] with torch.distributed on gloo."""
        import torch.distributed as dist

        self.init_process_group("gloo", timeout_s=60)
        value = torch.tensor([float(self.rank + 1), 1.0])
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return value.tolist()

    @register(Dispatch.RANK_ZERO)
    def rank_zero_echo(self, x: int) -> tuple[int, int]:
        return self.rank, x

    @register(Dispatch.PER_RANK)
    def per_rank(self, x: int) -> int:
        return 10 * x + self.rank

    @register(Dispatch.BROADCAST)
    def use_tensor_parallel(self, tp: int) -> None:
        self.set_dp_layout(self.rank // tp, self.world_size // tp, self.rank % tp == 0)

    @register(Dispatch.DP_COLLECT)
    def collector_rank(self) -> int:
        return self.rank

    @register(Dispatch.PER_RANK)
    def hold_memory(self, megabytes: int) -> int:
        """Touch ``megabytes`` MiB of fresh memory, then let it go: a peak the host must see."""
        block = bytearray(megabytes * 1024 * 1024)
        block[:: 4096] = b"x" * len(block[:: 4096])
        return len(block)

    @register(Dispatch.BROADCAST)
    def checksum(self, batch: Batch) -> float:
        """Sum of every tensor after adding 1 in place (received tensors must be writable)."""
        total = 0.0
        for key in batch.tensor_keys():
            value = batch[key].float()
            value.add_(1)
            total += float(value.sum())
        return total


@pytest.fixture(scope="module")
def group():
    if ray.is_initialized():
        ray.shutdown()
    init_ray(num_cpus=CLUSTER_CPUS, object_store_memory=200 * 1024**2)
    pool = ResourcePool([4], cpus_per_bundle=WORKER_CPUS, name="shards", timeout_s=30)
    wg = WorkerGroup(pool, ShardWorker)
    yield wg
    wg.shutdown()
    pool.remove()
    shutdown_ray()


def scores_batch(n: int) -> Batch:
    return Batch.from_dict({"scores": torch.arange(float(n))}, {"uid": [f"u{i}" for i in range(n)]})


@pytest.mark.parametrize(
    ("rows", "ranks"),
    [
        (10, [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]),  # padded to 12: shards of 3, the last has 2 padding rows
        (1, [0]),  # padded to 4: ranks 1..3 get only padding
        (8, [0, 0, 1, 1, 2, 2, 3, 3]),
    ],
)
def test_dp_split_returns_every_row_once_in_order(group, rows, ranks):
    out = group.tag_rows(scores_batch(rows))
    assert len(out) == rows
    assert out["scores"].tolist() == [float(i) for i in range(rows)]
    assert out["uid"] == [f"u{i}" for i in range(rows)]
    assert out["group"].tolist() == ranks


def test_padding_is_dropped_from_answers_with_two_rows_per_input(group):
    out = group.sample_twice(scores_batch(10))
    assert out["scores"].tolist() == [float(i) for i in range(10) for _ in range(2)]


def test_async_submit(group):
    call = group.tag_rows.submit(scores_batch(6))
    assert len(call.refs) == 4
    assert call.result()["scores"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_rank_environment(group):
    envs = group.environment()
    assert [e["rank"] for e in envs] == [0, 1, 2, 3]
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"}
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2", "3"]  # one node
    assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"4"}
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
    assert len({e["pid"] for e in envs}) == 4
    assert group.world_size == 4
    info = group.worker_info()
    assert [i["env"]["RANK"] for i in info] == ["0", "1", "2", "3"]


def test_init_ray_is_idempotent(group):
    assert init_ray(num_cpus=1) == ray.get_runtime_context().gcs_address
    assert ray.cluster_resources()["CPU"] == CLUSTER_CPUS


def test_gloo_process_group_all_reduce(group):
    # sum over ranks of (rank + 1) = 1 + 2 + 3 + 4 = 10; sum of ones = 4
    assert group.all_reduce_sum() == [[10.0, 4.0]] * 4


def test_rank_zero_per_rank_and_execute_all(group):
    assert group.rank_zero_echo(7) == (0, 7)
    assert group.per_rank([1, 2, 3, 4]) == [10, 21, 32, 43]
    with pytest.raises(
        DispatchError, match="per_rank.*one item per rank \\(4 items\\), got list of length 3"
    ):
        group.per_rank([1, 2, 3])
    assert group.execute_all("rank_zero_echo", 5) == [(0, 5), (1, 5), (2, 5), (3, 5)]
    assert group.execute_rank_zero("per_rank", 2) == 20
    with pytest.raises(AttributeError, match="has no method 'nope'"):
        group.execute_all("nope")


def test_tensor_parallel_layout_splits_by_dp_rank(group):
    group.use_tensor_parallel(2)  # ranks (0,1) and (2,3) each hold one data-parallel shard
    try:
        assert group.collector_rank() == [0, 2]
        out = group.tag_rows(scores_batch(5))  # padded to 6: shards of 3 on dp ranks 0 and 1
        assert out["scores"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert out["group"].tolist() == [0, 0, 0, 2, 2]
    finally:
        group.use_tensor_parallel(1)
    assert group.collector_rank() == [0, 1, 2, 3]


def test_batch_travels_to_workers_intact(group):
    b = Batch.from_dict(
        {"scores": torch.arange(4.0), "old_logprobs": torch.ones(4, 3, dtype=torch.bfloat16)},
        {"uid": ["a", "b", "c", "d"]},
    )
    # (0+1+2+3 + 4) + (12 ones + 12) = 10 + 24
    assert group.checksum(b) == [34.0] * 4
    assert torch.equal(b["scores"], torch.arange(4.0))  # the driver's copy is untouched
    back = ray.get(ray.put(b))
    assert back.keys() == b.keys() and torch.equal(back["old_logprobs"], b["old_logprobs"])


def test_resident_rows_stay_on_the_ranks_and_are_fetched_when_the_driver_reads_them(group):
    from verity.batch.transport import DRIVER_TRANSFERS

    DRIVER_TRANSFERS.take()
    rows = group.generate_resident(scores_batch(8))
    _, received = DRIVER_TRANSFERS.take()
    assert rows.resident_keys() == ["input_ids", "attention_mask"] and received < 8 * 64 * 8 // 2
    # a worker receiving the rows gets them whole, fetched from the rank that made them
    expected = torch.cat([torch.arange(128).view(2, 64) + 1000 * r for r in range(4)])
    assert torch.equal(group.sum_ids(rows.select("input_ids")), expected.sum(-1))
    DRIVER_TRANSFERS.take()
    # the driver reads the key like any other: fetched once, counted, then a key of the batch
    assert torch.equal(rows["input_ids"], expected)
    _, received = DRIVER_TRANSFERS.take()
    assert received == 8 * 64 * 8 and "input_ids" in rows.tensor_keys()
    assert torch.equal(group.sum_ids(rows.select("input_ids")), expected.sum(-1))


def test_ranks_whose_answer_is_not_read_send_none(group):
    from verity.batch.transport import DRIVER_TRANSFERS

    DRIVER_TRANSFERS.take()
    assert torch.equal(
        group.big_answer_rank_zero_reads(scores_batch(4)), torch.zeros(10_000, dtype=torch.long)
    )
    _, received = DRIVER_TRANSFERS.take()
    assert received == 8 * 10_000  # rank 0's answer, not four (ranks 1-3 sent None)
    # every rank still ran it: an error on any rank is raised as before
    with pytest.raises(WorkerMethodError, match="rank two refuses"):
        group.fail_on_rank_two(scores_batch(4))


# ---------------------------------------------------------------- bad input
def test_dp_split_with_something_other_than_a_batch(group):
    with pytest.raises(
        DispatchError,
        match="tag_rows \\(dispatch DP_SPLIT\\): argument 0 must be a verity.batch.Batch, got dict",
    ):
        group.tag_rows({"scores": torch.zeros(4)})
    with pytest.raises(DispatchError, match="argument 0 must be a verity.batch.Batch, got Tensor"):
        group.tag_rows(torch.zeros(4))


def test_unsplittable_batch(group):
    with pytest.raises(
        DispatchError, match="cannot split the batch across 4 data-parallel ranks.*empty batch"
    ):
        group.tag_rows(scores_batch(0))


def test_schema_violation_is_caught_before_dispatch(group):
    b = scores_batch(4)
    b["responses"] = torch.zeros(4, 5, dtype=torch.long)
    b["response_mask"] = torch.ones(4, 6)
    with pytest.raises(
        BatchSchemaError, match="tag_rows: argument 0: batch key 'response_mask'.*got \\[4, 6\\]"
    ):
        group.tag_rows(b)


def test_method_error_names_method_and_rank(group):
    with pytest.raises(WorkerMethodError) as err:
        group.fail_on_rank_two(scores_batch(8))
    assert err.value.rank == 2 and err.value.method == "fail_on_rank_two"
    assert "ShardWorker.fail_on_rank_two failed on rank 2: ValueError: rank two refuses this batch" in str(
        err.value
    )
    assert isinstance(err.value.cause, ValueError)
    assert len(group.tag_rows(scores_batch(3))) == 3  # the group still works


def test_pool_larger_than_the_cluster_fails_at_once(group):
    with pytest.raises(ResourceUnavailableError) as err:
        ResourcePool([64], name="huge")
    message = str(err.value)
    assert "'huge' asked for [64] bundles of {CPU: 1} ({CPU: 64} in all" in message
    assert "the whole cluster has only {CPU: 4}" in message


def test_pool_waiting_for_busy_resources_times_out(group):
    # 4 CPUs exist but the group holds 2: three more cannot be reserved
    with pytest.raises(ResourceUnavailableError) as err:
        ResourcePool([3], cpus_per_bundle=1, name="busy", timeout_s=1)
    message = str(err.value)
    assert "'busy' asked for [3] bundles of {CPU: 1}" in message
    assert "not reserved within 1 s" in message and "{CPU: 4} in total and {CPU: 2} free now" in message
    # the failed reservation was released: two CPUs can still be reserved
    with ResourcePool([2], cpus_per_bundle=1, name="fits", timeout_s=30) as pool:
        assert pool.world_size == 2 and len(set(pool.slot_node_ids)) == 1


def test_every_method_s_memory_peak_is_measured_and_the_largest_rank_wins(group) -> None:
    group.memory_peaks()  # what earlier tests left
    group.hold_memory([8, 8, 8, 300])  # rank 3 alone touches 300 MiB
    group.collector_rank()
    peaks = group.memory_peaks()
    # a group of one role names its peaks after the group: <group>/<method>
    (held_device, held), (_, light) = peaks[f"{group.name}/hold_memory"], peaks[f"{group.name}/collector_rank"]
    assert held_device is None  # CPU workers: the host's resident set is the figure
    assert held - light > 250 * 1024**2, (held, light)  # the peak is reset before each method
    assert group.memory_peaks() == {}  # taken: the next step starts empty
