"""Dispatch/collect planning of group calls, without Ray (the pure part of the controller)."""

from __future__ import annotations

import pytest
import torch
from verity.batch import Batch, BatchSchemaError
from verity.controller import Collect, Dispatch, DispatchError, DPLayout, Worker, register, registered_methods
from verity.controller.dispatch import MethodSpec, collect_results, dp_collectors, plan_call


def scores_batch(n: int) -> Batch:
    return Batch.from_dict({"scores": torch.arange(float(n))}, {"uid": [f"u{i}" for i in range(n)]})


def plain_layouts(world: int) -> list[DPLayout]:
    return [DPLayout(r, world, True) for r in range(world)]


def tp_layouts(world: int, tp: int) -> list[DPLayout]:
    """Tensor-parallel groups of ``tp`` consecutive ranks; the first of each group answers."""
    return [DPLayout(r // tp, world // tp, r % tp == 0) for r in range(world)]


SPLIT = MethodSpec(Dispatch.DP_SPLIT, Collect.DP_CONCAT)


# ---------------------------------------------------------------- register
class Base(Worker):
    @register(Dispatch.DP_SPLIT)
    def compute(self, batch):
        return batch

    @register
    def init_model(self):
        return None

    @register("rank_zero")
    def save(self, path):
        return path

    @register(Dispatch.DP_COLLECT, collect=Collect.NONE, check_schema=False)
    def update(self, batch):
        return None

    def plain(self):
        return 1


class Child(Base):
    def compute(self, batch):  # overrides without re-registering: keeps DP_SPLIT
        return batch


def test_register_defaults_and_inheritance():
    specs = registered_methods(Child)
    assert sorted(specs) == ["compute", "init_model", "save", "update"]
    assert specs["compute"] == MethodSpec(Dispatch.DP_SPLIT, Collect.DP_CONCAT, True)
    assert specs["init_model"] == MethodSpec(Dispatch.BROADCAST, Collect.ALL, True)
    assert specs["save"] == MethodSpec(Dispatch.RANK_ZERO, Collect.RANK_ZERO, True)
    assert specs["update"] == MethodSpec(Dispatch.DP_COLLECT, Collect.NONE, False)


def test_register_rejects_impossible_combination():
    with pytest.raises(ValueError, match="RANK_ZERO calls only rank 0 and cannot collect DP_CONCAT"):
        register(Dispatch.RANK_ZERO, Collect.DP_CONCAT)
    with pytest.raises(ValueError):
        register("scatter")


# ---------------------------------------------------------------- planning
def test_broadcast_shares_batches_once():
    shared = []

    def share(value):
        shared.append(value)
        return ("ref", len(shared))

    b = scores_batch(3)
    plan = plan_call(
        "g.m", MethodSpec(Dispatch.BROADCAST, Collect.ALL), (b, 5), {"k": b}, plain_layouts(3), share
    )
    assert [rank for rank, _, _ in plan.calls] == [0, 1, 2]
    assert all(args == (("ref", 1), 5) and kwargs == {"k": ("ref", 2)} for _, args, kwargs in plan.calls)
    assert len(shared) == 2


def test_rank_zero_and_per_rank():
    plan = plan_call("g.m", MethodSpec(Dispatch.RANK_ZERO, Collect.RANK_ZERO), (1,), {}, plain_layouts(4))
    assert plan.calls == [(0, (1,), {})]
    per = MethodSpec(Dispatch.PER_RANK, Collect.ALL)
    plan = plan_call("g.m", per, ([10, 11, 12],), {"seed": (0, 1, 2)}, plain_layouts(3))
    assert [(a, k) for _, a, k in plan.calls] == [
        ((10,), {"seed": 0}),
        ((11,), {"seed": 1}),
        ((12,), {"seed": 2}),
    ]
    with pytest.raises(
        DispatchError, match=r"g.m \(dispatch PER_RANK\): argument 0 must be a list.*3 items.*length 2"
    ):
        plan_call("g.m", per, ([10, 11],), {}, plain_layouts(3))
    with pytest.raises(DispatchError, match="argument 0 must be a list.*got int"):
        plan_call("g.m", per, (7,), {}, plain_layouts(3))


def test_dp_split_plans_padded_shards():
    plan = plan_call("g.compute", SPLIT, (scores_batch(10),), {"temperature": 0.7}, plain_layouts(4))
    assert plan.shard_rows == [3, 3, 3, 3] and plan.shard_pads == [0, 0, 0, 2]
    assert [args[0]["scores"].tolist() for _, args, _ in plan.calls][3] == [9.0, 0.0, 1.0]
    assert all(kwargs == {"temperature": 0.7} for _, _, kwargs in plan.calls)


def test_dp_split_with_tensor_parallel_peers():
    sent = []
    plan = plan_call(
        "g.compute", SPLIT, (scores_batch(5),), {}, tp_layouts(4, 2), lambda v: sent.append(v) or v
    )
    shards = [args[0]["scores"].tolist() for _, args, _ in plan.calls]
    assert shards == [[0.0, 1.0, 2.0], [0.0, 1.0, 2.0], [3.0, 4.0, 0.0], [3.0, 4.0, 0.0]]
    assert len(sent) == 2  # each shard shared once for its two ranks


def test_dp_split_rejects_wrong_shapes():
    with pytest.raises(
        DispatchError,
        match=r"g.compute \(dispatch DP_SPLIT\): argument 0 must be a verity.batch.Batch, got dict",
    ):
        plan_call("g.compute", SPLIT, ({"scores": torch.zeros(3)},), {}, plain_layouts(2))
    with pytest.raises(DispatchError, match="expected at least one verity.batch.Batch argument"):
        plan_call("g.compute", SPLIT, (), {"x": 1}, plain_layouts(2))
    with pytest.raises(
        DispatchError, match="cannot split the batch across 2 data-parallel ranks.*empty batch"
    ):
        plan_call("g.compute", SPLIT, (scores_batch(0),), {}, plain_layouts(2))
    with pytest.raises(DispatchError, match="Batch arguments have different sizes"):
        plan_call("g.compute", SPLIT, (scores_batch(3), scores_batch(4)), {}, plain_layouts(2))


def test_schema_is_checked_at_dispatch():
    b = scores_batch(4)
    b["old_log_probs"] = torch.zeros(4, 3)
    with pytest.raises(
        BatchSchemaError, match=r"g.compute: argument 0: .*\['old_log_probs'\] are not declared"
    ):
        plan_call("g.compute", SPLIT, (b,), {}, plain_layouts(2))
    unchecked = MethodSpec(Dispatch.DP_SPLIT, Collect.DP_CONCAT, check_schema=False)
    assert len(plan_call("g.compute", unchecked, (b,), {}, plain_layouts(2)).calls) == 2


def test_dp_collectors_validation():
    assert dp_collectors("m", tp_layouts(6, 3)) == (2, [0, 3])
    with pytest.raises(DispatchError, match="disagree on dp_size"):
        dp_collectors("m", [DPLayout(0, 2), DPLayout(1, 3)])
    with pytest.raises(DispatchError, match=r"ranks 0 and 1 are both collectors of dp_rank 0"):
        dp_collectors("m", [DPLayout(0, 2), DPLayout(0, 2)])
    with pytest.raises(DispatchError, match=r"no collector rank for dp_rank\(s\) \[1\]"):
        dp_collectors("m", [DPLayout(0, 2), DPLayout(1, 2, False)])


# ---------------------------------------------------------------- collecting
def _answers_from(plan, fn):
    return {rank: fn(rank, args[0]) for rank, args, _ in plan.calls}


def test_collect_concat_drops_padding_in_order():
    layouts = plain_layouts(4)
    plan = plan_call("g.compute", SPLIT, (scores_batch(10),), {}, layouts)
    # a worker builds a fresh answer (no pad_rows of its own): padding inferred from the shard
    answers = _answers_from(plan, lambda rank, b: Batch.from_dict({"scores": b["scores"] + 100 * rank}))
    out = collect_results("g.compute", SPLIT, plan, answers, layouts)
    assert out["scores"].tolist() == [0, 1, 2, 103, 104, 105, 206, 207, 208, 309]


def test_collect_answers_with_k_rows_per_input_row():
    layouts = plain_layouts(4)
    plan = plan_call("g.gen", SPLIT, (scores_batch(5),), {}, layouts)
    answers = _answers_from(
        plan, lambda rank, b: Batch.from_dict({"scores": b["scores"].repeat_interleave(3)})
    )
    out = collect_results("g.gen", SPLIT, plan, answers, layouts)
    assert out["scores"].tolist() == [float(i) for i in range(5) for _ in range(3)]
    bad = _answers_from(plan, lambda rank, b: Batch.from_dict({"scores": torch.zeros(len(b) + 1)}))
    with pytest.raises(
        DispatchError, match="rank 2 \\(dp_rank 2\\) returned 3 rows for a shard of 2 rows with 1 padding"
    ):
        collect_results("g.gen", SPLIT, plan, bad, layouts)


def test_collect_tensor_none_and_other_answers():
    layouts = tp_layouts(4, 2)
    plan = plan_call("g.compute", SPLIT, (scores_batch(3),), {}, layouts)
    tensors = _answers_from(plan, lambda rank, b: b["scores"] * 10)
    assert collect_results("g.compute", SPLIT, plan, tensors, layouts).tolist() == [0.0, 10.0, 20.0]
    nones = _answers_from(plan, lambda rank, b: None)
    assert collect_results("g.compute", SPLIT, plan, nones, layouts) is None
    dicts = _answers_from(plan, lambda rank, b: {"rank": rank})
    assert collect_results("g.compute", SPLIT, plan, dicts, layouts) == [{"rank": 0}, {"rank": 2}]


def test_collect_all_rank_zero_and_dp():
    layouts = tp_layouts(4, 2)
    plan = plan_call("g.m", MethodSpec(Dispatch.BROADCAST, Collect.ALL), (), {}, layouts)
    answers = {rank: rank * 10 for rank in range(4)}
    assert collect_results("g.m", MethodSpec(Dispatch.BROADCAST, Collect.ALL), plan, answers, layouts) == [
        0,
        10,
        20,
        30,
    ]
    assert collect_results("g.m", MethodSpec(Dispatch.DP_COLLECT, Collect.DP), plan, answers, layouts) == [
        0,
        20,
    ]
    assert (
        collect_results("g.m", MethodSpec(Dispatch.BROADCAST, Collect.RANK_ZERO), plan, answers, layouts) == 0
    )
    assert (
        collect_results("g.m", MethodSpec(Dispatch.BROADCAST, Collect.NONE), plan, answers, layouts) is None
    )


# ---------------------------------------------------------------- Worker outside a group
def test_named_layout_splits_and_collects_by_replica(monkeypatch):
    """A method registered with ``layout="rollout"`` splits by the workers' rollout layout (tensor-parallel
    replicas of 2 ranks over 4 data-parallel ranks); every other method keeps the main one."""
    by_replica = MethodSpec(Dispatch.DP_SPLIT, Collect.DP_CONCAT, layout="rollout")
    workers = []
    for rank in range(4):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "4")
        worker = Base()
        worker.set_dp_layout(rank // 2, 2, rank % 2 == 0, name="rollout")
        workers.append(worker._dp_layout())
    plan = plan_call("g.generate", by_replica, (scores_batch(4),), {}, workers)
    assert [args[0]["scores"].tolist() for _, args, _ in plan.calls] == [[0.0, 1.0], [0.0, 1.0], [2.0, 3.0], [2.0, 3.0]]
    answers = _answers_from(plan, lambda rank, b: Batch.from_dict({"scores": b["scores"] + 100 * rank}))
    out = collect_results("g.generate", by_replica, plan, answers, workers)
    assert out["scores"].tolist() == [0, 1, 202, 203]  # ranks 0 and 2 answer for their replicas
    plain = plan_call("g.compute", SPLIT, (scores_batch(4),), {}, workers)
    assert [args[0]["scores"].tolist() for _, args, _ in plain.calls] == [[0.0], [1.0], [2.0], [3.0]]
    assert registered_methods(type("W", (Worker,), {"g": register(Dispatch.DP_SPLIT, layout="rollout")(lambda s, b: b)}))[
        "g"
    ].layout == "rollout"


def test_worker_defaults_outside_a_group(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    w = Base()
    assert (w.rank, w.world_size, w.local_rank, w.dp_rank, w.dp_size, w.is_dp_collector) == (
        0,
        1,
        0,
        0,
        1,
        True,
    )
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert (w.rank, w.dp_rank, w.dp_size) == (3, 3, 4)
    w.set_dp_layout(1, 2, is_dp_collector=False)
    assert (w.dp_rank, w.dp_size, w.is_dp_collector) == (1, 2, False)
    with pytest.raises(ValueError, match=r"dp_rank must be an int in \[0, 2\)"):
        w.set_dp_layout(2, 2)
    with pytest.raises(RuntimeError, match="not part of a worker group"):
        w.peer("ref")


def test_init_ray_argument_checks_happen_before_starting_ray():
    import ray
    from verity.controller import init_ray

    if ray.is_initialized():
        pytest.skip("Ray already running in this process")
    with pytest.raises(ValueError, match="num_cpus and temp_dir apply only when starting a local cluster"):
        init_ray(address="10.0.0.1:6379", num_cpus=2)
    with pytest.raises(ValueError, match="Ray's socket paths under it must stay short"):
        init_ray(temp_dir="/tmp/" + "d" * 60)
    assert not ray.is_initialized()
