"""Skipping rows whose advantage is zero (``actor.skip_zero_advantage``): the gradient and the step stay exact.

The engine runs forward + backward over the rows of ``train_rows`` only, with the
normalisers of the whole mini-batch. Each check compares against the same engine
given every row; the KL case shows the comparison can fail (a KL term has a gradient
on zero-advantage rows, which is why ``auto`` does not skip there).
"""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import R, initial_logprobs, make_grouped_batch, tiny_qwen2
from verity.algorithms.configs import KLConfig, PolicyLossConfig
from verity.config import ConfigError, load_config
from verity.config.derived import skips_zero_advantage_rows, zero_advantage_rows_matter
from verity.engines import FSDP2Engine, OptimConfig
from verity.engines.train_rows import rows_with_advantage, trained_row_index
from verity.workers.actor_rollout import make_actor_loss

CFG = OptimConfig(lr=1e-2, warmup_steps=0, grad_clip=1.0)
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def grpo_batch(zero_groups: tuple[int, ...], rows: int = 16, group: int = 4, seed: int = 1) -> dict:
    """GRPO-shaped rows with per-row advantages; the groups in ``zero_groups`` get advantage 0.

    ``old_logprobs`` are the initial policy's plus noise, so ratios fall on both sides of the
    clip range; advantages are constant along a row, as a group-relative estimator gives.
    """
    batch = make_grouped_batch(rows=rows, group=group, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    per_row = torch.randn(rows, generator=g)
    for index in zero_groups:
        per_row[index * group : (index + 1) * group] = 0.0
    batch["advantages"] = per_row[:, None].expand(rows, R).clone()
    logprobs = initial_logprobs(batch)
    batch["old_logprobs"] = logprobs + 0.3 * torch.randn(logprobs.shape, generator=g)
    batch["ref_logprobs"] = logprobs + 0.3 * torch.randn(logprobs.shape, generator=g)
    return batch


def policy_only(name: str = "ppo", mode: str = "token-mean", **policy):
    return make_actor_loss(PolicyLossConfig(name=name, loss_agg_mode=mode, **policy), KLConfig(), 0.0)


def gradients(batch: dict, loss_fn, mbs: int, train_rows=None) -> tuple[dict, dict]:
    engine = FSDP2Engine(tiny_qwen2(), CFG)
    metrics = engine.forward_backward(batch, loss_fn, mbs, train_rows=train_rows)
    return engine.full_gradients(), metrics


def assert_same(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), what
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{what}: {n}: {m}")


def test_rows_with_advantage_reads_only_response_tokens():
    adv = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.5, 0.0], [0.0, 0.0, 2.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 0], [1, 0, 0]])
    # row 2's only non-zero advantage sits on padding
    assert rows_with_advantage(adv, mask).tolist() == [False, True, False, True]
    with pytest.raises(ValueError, match="advantages"):
        rows_with_advantage(adv[:, :2], mask)


def test_an_all_masked_rank_keeps_its_first_row_and_a_bad_mask_is_named():
    assert trained_row_index(None, 4) is None
    assert trained_row_index(torch.tensor([False, True, False, True]), 4).tolist() == [1, 3]
    assert trained_row_index(torch.zeros(4, dtype=torch.bool), 4).tolist() == [0]
    assert trained_row_index(torch.zeros(0, dtype=torch.bool), 0).tolist() == []
    with pytest.raises(ValueError, match="train_rows"):
        trained_row_index(torch.ones(4), 4)
    with pytest.raises(ValueError, match="train_rows"):
        trained_row_index(torch.ones(3, dtype=torch.bool), 4)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("mbs", [1, 4, 16])
def test_ppo_gradient_is_unchanged_when_zero_advantage_rows_are_skipped(mode, mbs):
    batch = grpo_batch(zero_groups=(0, 2))
    loss_fn = policy_only("ppo", mode, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    keep = rows_with_advantage(batch["advantages"], batch["response_mask"])
    assert keep.sum() == 8
    want, full = gradients(batch, loss_fn, mbs)
    got, skipped = gradients(batch, loss_fn, mbs, train_rows=keep)
    assert_same(got, want, f"{mode}/{mbs}")
    assert skipped["loss"] == pytest.approx(full["loss"], rel=1e-5, abs=1e-7)
    assert skipped["response_tokens"] == full["response_tokens"]  # normalised over every row
    assert skipped["skipped_row_fraction"] == 0.5 and full["skipped_row_fraction"] == 0.0
    kept_tokens = float(batch["attention_mask"][keep].sum())
    assert skipped["trained_tokens"] == kept_tokens
    assert full["trained_tokens"] == float(batch["attention_mask"].sum())


@pytest.mark.parametrize("name", ["gspo", "gpg", "cispo"])
def test_other_vanishing_losses_keep_their_gradient(name):
    batch = grpo_batch(zero_groups=(1,))
    mode = "seq-mean-token-mean" if name == "gspo" else "token-mean"
    loss_fn = policy_only(name, mode)
    keep = rows_with_advantage(batch["advantages"], batch["response_mask"])
    want, _ = gradients(batch, loss_fn, 4)
    got, _ = gradients(batch, loss_fn, 4, train_rows=keep)
    assert_same(got, want, name)


def test_a_kl_term_makes_skipping_wrong_so_the_check_can_fail():
    batch = grpo_batch(zero_groups=(0, 2))
    loss_fn = make_actor_loss(PolicyLossConfig(), KLConfig(use_kl_loss=True, kl_loss_coef=0.5), 0.0)
    keep = rows_with_advantage(batch["advantages"], batch["response_mask"])
    want, _ = gradients(batch, loss_fn, 4)
    got, _ = gradients(batch, loss_fn, 4, train_rows=keep)
    with pytest.raises(AssertionError):
        assert_same(got, want, "kl")


def test_entropy_is_the_mean_over_the_rows_run():
    batch = grpo_batch(zero_groups=(0, 3))
    keep = rows_with_advantage(batch["advantages"], batch["response_mask"])
    engine = FSDP2Engine(tiny_qwen2(), CFG)
    _, entropy = engine.compute_logprobs(batch, 16)
    mask = batch["response_mask"]
    _, metrics = gradients(batch, policy_only(), 4, train_rows=keep)
    want = float((entropy * mask)[keep].sum() / mask[keep].sum())
    assert metrics["entropy"] == pytest.approx(want, rel=1e-5)


def test_optimizer_steps_match_even_when_a_whole_mini_batch_has_zero_advantage():
    """AdamW keeps moving on momentum through a zero-gradient step; the skipping engine must too."""
    loss_fn = policy_only()
    batches = [grpo_batch(zero_groups=(1,), seed=3), grpo_batch(zero_groups=(0, 1, 2, 3), seed=4)]
    engines = {"all": FSDP2Engine(tiny_qwen2(), CFG), "skip": FSDP2Engine(tiny_qwen2(), CFG)}
    for batch in batches:
        keep = rows_with_advantage(batch["advantages"], batch["response_mask"])
        engines["all"].train_step(batch, loss_fn, 4)
        metrics = engines["skip"].train_step(batch, loss_fn, 4, train_rows=keep)
    assert metrics["skipped_row_fraction"] == 1.0
    assert metrics["loss"] == 0.0
    # the one row run to keep every gradient defined is counted as trained tokens
    assert 0 < metrics["trained_tokens"] < float(batches[1]["attention_mask"].sum())
    moved = engines["all"].model.state_dict()
    for name, value in engines["skip"].model.state_dict().items():
        torch.testing.assert_close(value, moved[name], rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    untouched = tiny_qwen2().state_dict()
    assert any(not torch.equal(value, untouched[name]) for name, value in moved.items())


def test_the_config_key_is_used_or_rejected():
    cfg = load_config([])
    assert cfg.actor.skip_zero_advantage == "auto" and skips_zero_advantage_rows(cfg)
    assert not skips_zero_advantage_rows(load_config(["actor.skip_zero_advantage=off"]))
    assert skips_zero_advantage_rows(load_config(["actor.skip_zero_advantage=on"]))
    kl = load_config(["algorithm.kl.use_kl_loss=true"])
    assert "use_kl_loss" in zero_advantage_rows_matter(kl) and not skips_zero_advantage_rows(kl)
    entropy = load_config(["actor.entropy_coeff=0.01"])
    assert "entropy_coeff" in zero_advantage_rows_matter(entropy)
    cov = load_config(["actor.policy_loss.name=clip_cov"])
    assert not skips_zero_advantage_rows(cov)
    with pytest.raises(ConfigError, match="actor.skip_zero_advantage=on would change the gradient: algorithm.kl"):
        load_config(["actor.skip_zero_advantage=on", "algorithm.kl.use_kl_loss=true"])
    with pytest.raises(ConfigError, match="actor.skip_zero_advantage must be one of auto|on|off"):
        load_config(["actor.skip_zero_advantage=yes"])
