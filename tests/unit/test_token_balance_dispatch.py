"""Token-balanced group calls: the dispatch reorders rows over the ranks and puts answers back in order."""

from __future__ import annotations

import random

import pytest
import torch
from verity.batch import Batch
from verity.batch.balance import BALANCE_META, BalanceRequest
from verity.config import load_config
from verity.controller import Collect, Dispatch, DispatchError, DPLayout
from verity.controller.dispatch import MethodSpec, collect_results, plan_call
from verity.trainer.stages import StepContext, old_log_prob, ref_log_prob, update_actor, update_critic

SPLIT = MethodSpec(Dispatch.DP_SPLIT, Collect.DP_CONCAT)
UPDATE = MethodSpec(Dispatch.DP_SPLIT, Collect.RANK_ZERO)


def layouts(world: int) -> list[DPLayout]:
    return [DPLayout(r, world, True) for r in range(world)]


def rows_of(lengths: list[int], width: int = 64) -> Batch:
    """Rows whose attention mask holds ``lengths[i]`` ones (right-aligned), ``row_id`` = their index."""
    mask = (torch.arange(width) >= width - torch.tensor(lengths)[:, None]).long()
    return Batch.from_dict({"attention_mask": mask, "scores": torch.arange(float(len(lengths)))})


def long_tail(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return sorted(max(1, min(64, int(rng.lognormvariate(2.3, 0.8)))) for _ in range(n))


def answer_each_rank(plan) -> dict[int, Batch]:
    """A worker that answers ``2 x scores`` for its rows (one row per row, padding included)."""
    return {rank: Batch.from_dict({"scores": 2 * args[0]["scores"]}) for rank, args, _ in plan.calls}


def shard_tokens(plan) -> list[int]:
    return [
        int(args[0]["attention_mask"][: len(args[0]) - args[0].pad_rows].sum()) for _, args, _ in plan.calls
    ]


@pytest.mark.parametrize(("rows", "world"), [(32, 2), (30, 4), (7, 2), (5, 4)])
def test_balanced_call_balances_ranks_and_restores_the_order(rows: int, world: int) -> None:
    lengths = long_tail(rows, rows)
    batch = rows_of(lengths)
    plain = plan_call("actor.compute_log_prob", SPLIT, (batch,), {}, layouts(world))
    request = batch.select(*batch.keys())
    request.meta[BALANCE_META] = BalanceRequest()
    plan = plan_call("actor.compute_log_prob", SPLIT, (request,), {}, layouts(world))
    before, after = shard_tokens(plain), shard_tokens(plan)
    assert max(after) - min(after) <= max(before) - min(before)
    if rows % world == 0:
        assert max(after) - min(after) <= max(lengths)
    assert all(BALANCE_META not in args[0].meta for _, args, _ in plan.calls)  # stays on the driver
    joined = collect_results("actor.compute_log_prob", SPLIT, plan, answer_each_rank(plan), layouts(world))
    assert torch.equal(joined["scores"], 2 * batch["scores"])  # the batch's order again
    tensors = {rank: 2 * args[0]["scores"] for rank, args, _ in plan.calls}
    assert torch.equal(collect_results("x", SPLIT, plan, tensors, layouts(world)), 2 * batch["scores"])


def test_balanced_update_keeps_each_row_in_its_mini_batch() -> None:
    lengths = long_tail(32, 3)
    request = rows_of(lengths)
    request.meta[BALANCE_META] = BalanceRequest(mini_batch_rows=8)
    plan = plan_call("actor.update_actor", UPDATE, (request,), {}, layouts(2))
    for mini in range(4):  # each rank's mini-batch j is its rows [4j, 4j+4): the same rows as unbalanced
        got = {int(v) for _, args, _ in plan.calls for v in args[0]["scores"][4 * mini : 4 * mini + 4]}
        want = {r * 16 + 4 * mini + i for r in range(2) for i in range(4)}
        assert got == want
        loads = [int(args[0]["attention_mask"][4 * mini : 4 * mini + 4].sum()) for _, args, _ in plan.calls]
        assert abs(loads[0] - loads[1]) <= max(lengths)


def sp_layouts(world: int, sp: int) -> list[DPLayout]:
    """Ulysses SP groups of ``sp`` consecutive ranks sharing rows (the engine's ``dp_layout``), the
    group's first rank collecting; each rank generating its own prompts (the ``rollout`` layout)."""
    return [
        DPLayout(r // sp, world // sp, r % sp == 0, named=(("rollout", DPLayout(r, world, True)),))
        for r in range(world)
    ]


@pytest.mark.parametrize("mini_batch_rows", [0, 8])
def test_balanced_call_under_sp_gives_each_sp_group_the_same_rows(mini_batch_rows: int) -> None:
    lengths = long_tail(32, 5)
    batch = rows_of(lengths)
    request = batch.select(*batch.keys())
    request.meta[BALANCE_META] = BalanceRequest(mini_batch_rows=mini_batch_rows)
    world_layouts = sp_layouts(4, 2)
    plan = plan_call("actor.update_actor", SPLIT, (request,), {}, world_layouts)
    shards = {rank: args[0] for rank, args, _ in plan.calls}
    # ranks 0, 1 form SP group 0 and ranks 2, 3 group 1: each pair holds identical rows, in the same order
    for first in (0, 2):
        assert torch.equal(shards[first]["scores"], shards[first + 1]["scores"])
        assert torch.equal(shards[first]["attention_mask"], shards[first + 1]["attention_mask"])
    # balanced over the 2 data-parallel groups, not the 4 ranks: 16 rows each, every row in one group
    assert [len(shards[r]) for r in range(4)] == [16] * 4
    assert sorted(torch.cat([shards[0]["scores"], shards[2]["scores"]]).tolist()) == list(range(32))
    plain = plan_call("actor.update_actor", SPLIT, (batch,), {}, world_layouts)
    before, after = shard_tokens(plain)[::2], shard_tokens(plan)[::2]
    assert max(after) - min(after) <= min(max(before) - min(before), max(lengths))
    # the answers of the groups' collectors, put back in the batch's order
    joined = collect_results("actor.update_actor", SPLIT, plan, answer_each_rank(plan), world_layouts)
    assert torch.equal(joined["scores"], 2 * batch["scores"])
    # a method split by the rollout layout still reaches every rank with rows of its own
    rollout = MethodSpec(Dispatch.DP_SPLIT, Collect.DP_CONCAT, layout="rollout")
    generate = plan_call("actor.generate", rollout, (batch,), {}, world_layouts)
    assert [len(args[0]) for _, args, _ in generate.calls] == [8] * 4


def test_costs_given_and_nothing_to_balance() -> None:
    batch = rows_of([3, 3, 3, 3])
    request = batch.select(*batch.keys())
    request.meta[BALANCE_META] = BalanceRequest(costs=torch.tensor([9, 8, 0, 0]))
    plan = plan_call("x", SPLIT, (request,), {}, layouts(2))
    shards = [set(args[0]["scores"].tolist()) for _, args, _ in plan.calls]
    assert {0.0, 1.0} not in [s & {0.0, 1.0} for s in shards]  # the two costly rows on different ranks
    assert plan_call("x", SPLIT, (batch,), {}, layouts(2)).order is None  # no request: as given
    request.meta[BALANCE_META] = BalanceRequest(costs=torch.tensor([1, 2, 3]))
    with pytest.raises(DispatchError, match="costs have shape"):
        plan_call("x", SPLIT, (request,), {}, layouts(2))


class RecordingActor:
    """An actor handle that records the requests its group calls got."""

    def __init__(self) -> None:
        self.requests: dict[str, Batch] = {}

    def compute_log_prob(self, batch: Batch) -> Batch:
        self.requests["compute_log_prob"] = batch
        return Batch.from_dict({"old_logprobs": torch.zeros(batch["responses"].shape)})

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        self.requests["compute_ref_log_prob"] = batch
        return Batch.from_dict({"ref_logprobs": torch.zeros(batch["responses"].shape)})

    def update_actor(self, batch: Batch) -> dict[str, float]:
        self.requests["update_actor"] = batch
        return {}

    def update_critic(self, batch: Batch) -> dict[str, float]:
        self.requests["update_critic"] = batch
        return {}


def step_rows() -> Batch:
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    ids = torch.randint(1, 9, (4, 7))
    attention = torch.cat([torch.ones(4, 3, dtype=torch.long), mask], 1)
    ids[:, 3:] *= mask
    return Batch.from_dict(
        {
            "input_ids": ids,
            "attention_mask": attention,
            "position_ids": attention.cumsum(-1) - 1,
            "responses": ids[:, 3:],
            "response_mask": mask,
            "old_logprobs": torch.zeros(4, 4),
            "advantages": torch.tensor([[1.0] * 4, [0.0] * 4, [0.5] * 4, [0.0] * 4]),
            "values": torch.zeros(4, 4),
            "returns": torch.zeros(4, 4),
        }
    )


def test_stages_ask_for_balance_by_role_setting() -> None:
    cfg = load_config(
        ["actor.ppo_mini_batch_size=2", "rollout.n=2", "critic.enabled=true", "critic.ppo_mini_batch_size=1"]
    )
    actor = RecordingActor()
    ctx = StepContext(cfg, actor, None, None, step=1, critic=actor)
    batch = step_rows()
    old_log_prob(ctx, batch)
    ref_log_prob(ctx, batch)
    update_critic(ctx, batch)
    update_actor(ctx, batch)
    assert BALANCE_META not in batch.meta  # the step's batch is untouched
    for name in ("compute_log_prob", "compute_ref_log_prob"):
        assert actor.requests[name].meta[BALANCE_META] == BalanceRequest(0, None)
    assert actor.requests["update_critic"].meta[BALANCE_META].mini_batch_rows == 2
    update = actor.requests["update_actor"].meta[BALANCE_META]
    assert update.mini_batch_rows == 4
    # GRPO-style policy loss without KL or entropy: rows with zero advantage are skipped, so cost 0
    assert update.costs.tolist() == [6, 0, 4, 0]

    off = load_config(["actor.balance_tokens=false", "critic.enabled=true", "critic.balance_tokens=false"])
    actor = RecordingActor()
    ctx = StepContext(off, actor, None, None, step=1, critic=actor)
    old_log_prob(ctx, batch)
    ref_log_prob(ctx, batch)
    update_critic(ctx, batch)
    update_actor(ctx, batch)
    assert all(BALANCE_META not in request.meta for request in actor.requests.values())


def test_verl_dynamic_batch_keys_point_at_verity_keys() -> None:
    from verity.config.errors import ConfigError

    with pytest.raises(
        ConfigError, match=r"did you mean actor\.balance_tokens or actor\.fsdp2\.micro_batch_tokens"
    ):
        load_config(["actor_rollout_ref.actor.use_dynamic_bsz=true"])
    with pytest.raises(ConfigError, match=r"did you mean actor\.fsdp2\.micro_batch_tokens"):
        load_config(["actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=8192"])
    with pytest.raises(ConfigError, match=r"did you mean critic\.fsdp2\.micro_batch_tokens"):
        load_config(["critic.ppo_max_token_len_per_gpu=8192"])
    with pytest.raises(ConfigError, match="balance_tokens"):
        load_config(["actor.balance_tokens=maybe"])
