"""Overlong reward shaping (against hand-computed values) and overlong filtering (truncated rows out of the loss)."""

from __future__ import annotations

import pytest
import torch
from dapo_fakes import EOS, FakeActor, FakeLoader, FakeRewards
from verity.config import ConfigError, load_config
from verity.trainer.stages import StepContext, generate, reward
from verity_recipe_dapo.overlong import (
    overlong_filtered_update_actor,
    overlong_penalty,
    overlong_shaping,
    truncated_rows,
)


def test_penalty_at_the_buffers_start_middle_and_end():
    # L_max = 20 tokens, L_cache = 8: the buffer is (12, 20]
    lengths = torch.tensor([5, 12, 13, 16, 19, 20])
    penalty = overlong_penalty(lengths, max_length=20, buffer_len=8, penalty_factor=1.0)
    # before and at the start: 0; one token in: (12 - 13) / 8; middle: (12 - 16) / 8; end: (12 - 20) / 8
    assert penalty.tolist() == pytest.approx([0.0, 0.0, -0.125, -0.5, -0.875, -1.0])
    scaled = overlong_penalty(lengths, max_length=20, buffer_len=8, penalty_factor=0.5)
    assert scaled.tolist() == pytest.approx([0.0, 0.0, -0.0625, -0.25, -0.4375, -0.5])
    assert overlong_penalty(torch.tensor([30]), 20, 8).tolist() == [-1.0]  # beyond the budget: -1 (paper)
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(lengths, 20, 0)


def cfg(*extra: str):
    return load_config(
        [
            "data.train_batch_size=4",
            "rollout.n=4",
            "actor.ppo_mini_batch_size=2",
            "data.max_response_length=10",
            *extra,
        ]
    )


def generated(config, kinds: list[str]):
    actor = FakeActor()
    ctx = StepContext(config, actor, FakeRewards(), None, step=1, loader=None)
    batch = reward(ctx, generate(ctx, FakeLoader([kinds]).next_batch()))
    return ctx, batch, actor


def test_truncated_rows_are_full_length_without_eos():
    _, batch, _ = generated(cfg(), ["mixed", "mixed+long", "right", "wrong+long"])
    truncated = truncated_rows(batch, 10, [EOS])
    assert truncated.tolist() == [False] * 4 + [True] * 4 + [False] * 4 + [True] * 4
    ended = batch.select(*batch.keys())
    responses = ended["responses"].clone()
    responses[4:8, -1] = EOS  # full length, but the last token is EOS: finished, not truncated
    ended["responses"] = responses
    assert not truncated_rows(ended, 10, [EOS])[4:8].any()


def test_shaping_stage_adds_the_penalty_to_scores_and_token_rewards():
    config = cfg("dapo.overlong_shaping.enabled=true", "dapo.overlong_shaping.buffer_len=4")
    ctx, batch, _ = generated(config, ["mixed", "mixed+long", "right", "wrong"])
    before = batch["scores"].clone()
    shaped = overlong_shaping(ctx, batch)
    lengths = shaped["response_mask"].sum(-1).float()
    want = -((lengths - 6).clamp(min=0) / 4).clamp(max=1)
    assert torch.allclose(shaped["overlong_penalty"], want)
    assert torch.allclose(shaped["scores"], before + want)
    assert torch.allclose(
        shaped["token_rewards"].sum(-1), shaped["scores"]
    )  # the score sits on the last token
    assert shaped["scores"][4:8].tolist() == pytest.approx([0.0, -2.0, 0.0, -2.0])  # truncated: -1 more
    assert shaped["acc"].tolist() == batch["acc"].tolist()  # correctness is not shaped


def test_filtered_update_masks_truncated_rows_and_leaves_the_batch_alone():
    config = cfg("dapo.overlong_filter.enabled=true")
    ctx, batch, actor = generated(config, ["mixed", "mixed+long", "right", "wrong"])
    batch["old_logprobs"] = torch.zeros_like(batch["response_mask"], dtype=torch.float)
    batch["advantages"] = torch.ones_like(batch["response_mask"], dtype=torch.float)
    mask = batch["response_mask"].clone()
    out = overlong_filtered_update_actor(ctx, batch)
    assert out is batch and torch.equal(batch["response_mask"], mask)  # metrics still see every row
    (sent,) = actor.updates
    assert sent["response_mask"][4:8].sum() == 0  # the truncated prompt's four samples are out of the loss
    assert torch.equal(sent["response_mask"][:4], mask[:4]) and torch.equal(
        sent["response_mask"][8:], mask[8:]
    )
    assert ctx.metrics["dapo/overlong_filtered_share"] == 0.25


def test_section_checks_use_the_whole_config():
    with pytest.raises(
        ConfigError,
        match="dapo: overlong_shaping.buffer_len = 10 must be below data.max_response_length = 10",
    ):
        cfg("dapo.overlong_shaping.enabled=true", "dapo.overlong_shaping.buffer_len=10")
    with pytest.raises(ConfigError, match="dapo: dynamic_sampling needs rollout.n >= 2"):
        load_config(["rollout.n=1", "dapo.dynamic_sampling.enabled=true"])
    with pytest.raises(ConfigError, match="dapo: dynamic_sampling.metric must be one of acc|score"):
        cfg("dapo.dynamic_sampling.metric=reward")
    with pytest.raises(ConfigError, match="max_num_gen_batches must be >= 0"):
        cfg("dapo.dynamic_sampling.max_num_gen_batches=-1")


def test_the_overlong_filter_leaves_the_responses_on_the_ranks_that_score_them() -> None:
    """The filter reads ``batch["responses"]`` on the driver, which fetches them; no run keeps them back for it."""
    from verity.workers.rollout_side import resident_response_keys

    filtered = load_config(["reward.placement=workers", "dapo.overlong_filter.enabled=true"])
    assert "responses" in resident_response_keys(filtered)
    on_driver = load_config(["reward.placement=driver", "dapo.overlong_filter.enabled=true"])
    assert "responses" not in resident_response_keys(on_driver)
