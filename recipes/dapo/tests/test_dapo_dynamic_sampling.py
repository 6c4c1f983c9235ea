"""Dynamic sampling with a fake actor, reward and loader: refill, cap, batch composition, seeds, padding."""

from __future__ import annotations

import pytest
import torch
from dapo_fakes import FakeActor, FakeLoader, FakeRewards
from verity.config import load_config
from verity.trainer.stage_plan import build_stage_plan
from verity.trainer.stages import StepContext
from verity_recipe_dapo.dynamic_sampling import (
    DynamicSamplingExhausted,
    groups_with_signal,
    pad_prompt_side,
    round_seed,
)
from verity_recipe_dapo.plugin import zero_advantage_group_share

N = 4  # samples per prompt
P = 4  # prompts per batch


def config(*extra: str):
    return load_config(
        [
            f"data.train_batch_size={P}",
            f"rollout.n={N}",
            "actor.ppo_mini_batch_size=2",
            "data.max_response_length=10",
            "dapo.dynamic_sampling.enabled=true",
            "trainer.seed=3",
            *extra,
        ]
    )


def run_step(cfg, batches: list[list[str]], step: int = 5, actor: FakeActor | None = None):
    """Run the plan's stages up to (without) the actor update on the first batch; return ctx, batch, loader."""
    actor, loader = actor or FakeActor(), FakeLoader(batches)
    ctx = StepContext(cfg, actor, FakeRewards(), None, step=step, loader=loader)
    batch = loader.next_batch()  # what the loop draws for the step
    for stage in build_stage_plan(cfg).stages:
        if stage.name in ("old_log_prob", "update_actor"):
            continue
        batch = stage.run(ctx, batch)
    return ctx, batch, loader, actor


def test_plan_folds_generate_and_scoring_into_one_stage():
    names = build_stage_plan(config()).names()
    assert names == ["dynamic_sampling", "old_log_prob", "advantage", "dapo_signal", "update_actor"]
    shaped = build_stage_plan(
        config("dapo.overlong_shaping.enabled=true", "dapo.overlong_filter.enabled=true")
    )
    assert shaped.names() == names  # shaping runs inside the rounds; the filter keeps the update's name
    plain = build_stage_plan(load_config([])).names()
    assert plain == [
        "generate",
        "reward",
        "old_log_prob",
        "advantage",
        "update_actor",
    ]  # installed, switched off


def test_a_batch_where_every_group_is_degenerate_is_refilled_from_the_loader():
    batches = [
        ["right", "wrong", "right", "wrong"],
        ["mixed", "right", "mixed", "wrong"],
        ["mixed", "mixed", "wrong", "mixed"],
    ]
    ctx, batch, loader, actor = run_step(config(), batches)
    assert loader.drawn == 3  # the step's batch, then two more
    m = ctx.metrics
    assert (m["dapo/gen_rounds"], m["dapo/prompts_drawn"]) == (3.0, 12.0)
    assert m["dapo/groups_with_signal"] == 5.0 and m["dapo/groups_kept"] == float(P)
    assert m["dapo/signal_share"] == pytest.approx(5 / 12)
    assert len(batch) == P * N
    # the kept groups are the first four with a signal, in the order found: b1-0, b1-2, b2-0, b2-1
    assert [batch["uid"][i] for i in range(0, P * N, N)] == ["b1-0", "b1-2", "b2-0", "b2-1"]
    assert bool(groups_with_signal(batch["group"], batch["acc"]).all())
    assert len(set(batch["group"].tolist())) == P
    assert m["dapo/zero_adv_group_share"] == 0.0  # from the dapo_signal stage after advantage
    assert m["dapo/sampled_acc_mean"] == pytest.approx((2 * 4 + 2 * 2 + 1 * 4 + 3 * 2) / 48)
    # every round sampled with its own seed; round 1 with the built-in generate stage's
    assert actor.seeds == [round_seed(3, 5, r) for r in (1, 2, 3)] and actor.seeds[0] == 3 * 1_000_003 + 5
    assert len(set(actor.seeds)) == 3
    assert m["perf/generated_tokens"] > float(batch["response_mask"].sum())  # dropped samples count too


def test_rounds_of_different_prompt_widths_concatenate_with_prompts_left_padded():
    _, batch, _, _ = run_step(config(), [["wrong"] * 4, ["mixed", "wrong", "wrong", "wrong"], ["mixed"] * 4])
    width = batch["prompts"].shape[1]
    assert width == 5  # rounds had widths 4 and 5 (kept rows); the narrower ones were padded
    assert batch["input_ids"].shape[1] == width + 10
    assert torch.equal(batch["attention_mask"][:, :width].sum(-1), torch.full((len(batch),), 2))
    assert torch.equal(batch["position_ids"], (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0))
    assert (
        batch["input_ids"][0, : width - 2].eq(0).all()
        and batch["input_ids"][0, width - 2 : width].eq(7).all()
    )


def test_the_cap_fails_with_a_clear_message_and_zero_means_no_cap():
    degenerate = [["right", "wrong", "right", "wrong"]] * 3 + [["mixed"] * 4]
    with pytest.raises(DynamicSamplingExhausted) as err:
        run_step(config("dapo.dynamic_sampling.max_num_gen_batches=3"), degenerate)
    text = str(err.value)
    assert "after 3 generation rounds (12 prompts drawn)" in text and "only 0 of the 4 prompt groups" in text
    assert "dapo.dynamic_sampling.max_num_gen_batches (now 3; 0 = no cap)" in text
    ctx, batch, loader, _ = run_step(config("dapo.dynamic_sampling.max_num_gen_batches=0"), degenerate)
    assert loader.drawn == 4 and ctx.metrics["dapo/gen_rounds"] == 4.0 and len(batch) == P * N


def test_metric_score_keeps_groups_whose_shaped_scores_differ():
    # all wrong, but one prompt's samples are truncated and so punished: with metric=score the
    # group of a wrong prompt whose lengths differ has a signal, with metric=acc it has none
    shaped = ("dapo.overlong_shaping.enabled=true", "dapo.overlong_shaping.buffer_len=6")
    batches = [["wrong"] * 4, ["mixed"] * 4]
    ctx, batch, loader, _ = run_step(config(*shaped, "dapo.dynamic_sampling.metric=score"), batches)
    assert loader.drawn == 1 and ctx.metrics["dapo/groups_kept"] == 4.0  # lengths 2..7 > 4: penalties differ
    assert set(batch["acc"].tolist()) == {0.0}
    ctx, _, loader, _ = run_step(config(*shaped), batches)
    assert loader.drawn == 2  # by accuracy, the first batch had no signal


def test_one_round_suffices_when_every_group_has_a_signal():
    ctx, batch, loader, _ = run_step(config(), [["mixed"] * 4])
    assert loader.drawn == 1 and ctx.metrics["dapo/gen_rounds"] == 1.0 and len(batch) == P * N


def test_without_dynamic_sampling_degenerate_groups_stay_and_are_counted():
    cfg = config("dapo.dynamic_sampling.enabled=false", "dapo.overlong_filter.enabled=true")
    ctx, batch, loader, _ = run_step(cfg, [["right", "wrong", "mixed", "mixed"]])
    assert loader.drawn == 1 and len(batch) == P * N
    assert ctx.metrics["dapo/zero_adv_group_share"] == 0.5
    assert ctx.metrics["dapo/sampled_acc_mean"] == pytest.approx((4 + 0 + 2 + 2) / 16)


def test_groups_with_signal_and_zero_advantage_share_by_hand():
    group = torch.tensor([0, 0, 1, 1, 2, 2])
    assert groups_with_signal(group, torch.tensor([1.0, 1.0, 0.0, 1.0, -1.0, -1.0])).tolist() == [
        False, False, True, True, False, False
    ]  # fmt: skip
    advantages = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.5, 0.5], [-0.5, 0.0], [0.0, 0.0], [0.0, 2.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 0], [1, 1], [1, 0]]).float()
    # group 2's only non-zero advantage is on a masked token: it carries no gradient
    assert zero_advantage_group_share(group, advantages, mask) == pytest.approx(2 / 3)


def test_pad_prompt_side_leaves_response_columns_alone():
    _, batch, _, _ = run_step(config(), [["mixed"] * 4])
    padded = pad_prompt_side(batch, batch["prompts"].shape[1] + 3, pad_token_id=0)
    assert torch.equal(padded["responses"], batch["responses"])
    assert torch.equal(padded["input_ids"][:, 3:], batch["input_ids"])
    assert padded["attention_mask"][:, :3].eq(0).all()
    with pytest.raises(ValueError, match="below the batch's prompt width"):
        pad_prompt_side(batch, 1, pad_token_id=0)


def test_async_mode_and_dynamic_sampling_fail_at_start_naming_both():
    from verity.trainer.stage_plan import StagePlanError

    with pytest.raises(StagePlanError, match="stage planner 'dapo'.*'generate'.*trainer.mode=async"):
        build_stage_plan(config("trainer.mode=async"))
    # without dynamic sampling DAPO's other parts leave generation alone: async plans
    names = build_stage_plan(config("trainer.mode=async", "dapo.dynamic_sampling.enabled=false")).names()
    assert names[0] == "generate" and "rollout_sync" in names


def test_with_reward_placement_workers_every_round_is_scored_by_a_group_call() -> None:
    ctx, _, _, actor = run_step(config("reward.placement=workers"), [["same"] * P, ["mixed"] * P])
    assert actor.scored == [P * N] * int(ctx.metrics["dapo/gen_rounds"])
    ctx, _, _, actor = run_step(config("reward.placement=driver"), [["same"] * P, ["mixed"] * P])
    assert actor.scored == [] and ctx.metrics["dapo/gen_rounds"] >= 1
