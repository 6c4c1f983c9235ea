"""Truncated importance weights min(pi_old / pi_rollout, cap), by hand, in the actor loss, and their config."""

from __future__ import annotations

import math

import pytest
import torch
from verity.algorithms.aggregation import AggregationContext
from verity.algorithms.configs import KLConfig, PolicyLossConfig
from verity.algorithms.off_policy import truncated_importance_weights
from verity.config import ConfigError, load_config
from verity.config.derived import old_logprobs_source
from verity.workers.actor_rollout import make_actor_loss

# proximal probabilities 0.5, 0.2, 0.9, 0.3; sampler probabilities 0.25, 0.4, 0.1, 0.3
OLD = torch.log(torch.tensor([[0.5, 0.2, 0.9, 0.3]]))
ROLLOUT = torch.log(torch.tensor([[0.25, 0.4, 0.1, 0.3]]))
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the last token is padding


def test_weights_by_hand() -> None:
    weights, metrics = truncated_importance_weights(OLD, ROLLOUT, MASK, cap=3.0)
    # ratios 2, 0.5, 9 (capped to 3), and 0 outside the response
    torch.testing.assert_close(weights, torch.tensor([[2.0, 0.5, 3.0, 0.0]]))
    assert metrics["is_weight_mean"] == pytest.approx(5.5 / 3)
    assert metrics["is_ratio_mean"] == pytest.approx(11.5 / 3)
    assert metrics["is_capped_frac"] == pytest.approx(1 / 3)
    assert not weights.requires_grad
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_importance_weights(OLD, ROLLOUT, MASK, cap=0.0)
    with pytest.raises(ValueError, match="shapes differ"):
        truncated_importance_weights(OLD, ROLLOUT[:, :3], MASK, cap=2.0)


def test_actor_loss_weights_each_token_by_hand() -> None:
    """PPO clip at ratio 1 (current = proximal): loss = -token-mean(w * A)."""
    advantages = torch.tensor([[1.0, -2.0, 0.5, 7.0]])
    micro = {
        "response_mask": MASK,
        "advantages": advantages,
        "old_logprobs": OLD,
        "rollout_logprobs": ROLLOUT,
    }
    agg = AggregationContext(global_tokens=3.0, global_seqs=1.0, max_response_len=4)
    logprobs = OLD.clone().requires_grad_(True)
    entropy = torch.zeros_like(OLD)
    weighted = make_actor_loss(PolicyLossConfig(), KLConfig(), 0.0, is_cap=3.0)
    loss, metrics = weighted(micro, logprobs, entropy, agg)
    expected = -(2.0 * 1.0 + 0.5 * -2.0 + 3.0 * 0.5) / 3  # = -2.5 / 3
    assert float(loss.detach()) == pytest.approx(expected)
    assert metrics["actor/is_capped_frac"] == pytest.approx(1 / 3)
    # the gradient of each token's log-prob is -w_t A_t / 3 (ratio 1, inside the clip range)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-2.0, 1.0, -1.5, 0.0]]) / 3)
    plain, plain_metrics = make_actor_loss(PolicyLossConfig(), KLConfig(), 0.0)(micro, OLD, entropy, agg)
    assert float(plain) == pytest.approx(-(1.0 - 2.0 + 0.5) / 3)
    assert "actor/is_weight_mean" not in plain_metrics
    with pytest.raises(RuntimeError, match="needs rollout_logprobs"):
        weighted({k: v for k, v in micro.items() if k != "rollout_logprobs"}, OLD, entropy, agg)


def test_dual_clip_commutes_with_the_weight() -> None:
    """l(wA) = w l(A) for w >= 0, so weighting the advantage weights the per-token loss (dual clip too)."""
    cfg = PolicyLossConfig(clip_ratio_c=3.0)
    agg = AggregationContext(global_tokens=3.0, global_seqs=1.0, max_response_len=4)
    current = OLD + torch.tensor([[0.4, -0.6, 2.0, 0.0]])  # ratios outside the clip range both ways
    advantages = torch.tensor([[-1.0, 2.0, -3.0, 0.0]])
    micro = {
        "response_mask": MASK,
        "advantages": advantages,
        "old_logprobs": OLD,
        "rollout_logprobs": ROLLOUT,
    }
    loss, _ = make_actor_loss(cfg, KLConfig(), 0.0, is_cap=3.0)(micro, current, torch.zeros_like(OLD), agg)
    ratio = torch.exp(current - OLD)[0, :3]
    w = torch.tensor([2.0, 0.5, 3.0])
    a = advantages[0, :3]
    per_token = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2))
    per_token = torch.where(a < 0, torch.minimum(per_token, -a * 3.0), per_token)
    assert float(loss) == pytest.approx(float((w * per_token).sum() / 3), rel=1e-6)
    assert math.isfinite(float(loss))


def test_config_keys() -> None:
    assert load_config(["actor.off_policy.is_cap=2.0"]).actor.off_policy.is_cap == 2.0
    with pytest.raises(ConfigError, match="is_cap must be >= 0"):
        load_config(["actor.off_policy.is_cap=-1"])
    with pytest.raises(ConfigError, match="would be 1 everywhere"):
        load_config(["actor.off_policy.is_cap=2.0", "actor.old_logprobs=rollout"])
    with pytest.raises(ConfigError, match="trainer.mode must be one of sync|async"):
        load_config(["trainer.mode=fast"])
    with pytest.raises(ConfigError, match="trainer.max_staleness"):  # removed: async is one update behind
        load_config(["trainer.mode=async", "trainer.max_staleness=2"])
    # async is never on-policy: the update cannot stand in for the behaviour log-probs
    assert old_logprobs_source(load_config(["trainer.mode=async"])) == "recompute"
    assert old_logprobs_source(load_config([])) == "policy"


def test_resuming_an_async_run_from_its_final_checkpoint_warns_that_one_step_is_on_policy(tmp_path, caplog):
    from verity.trainer.async_rollout import AsyncRollout

    rollout = AsyncRollout(cfg=None, group=None)
    with caplog.at_level("WARNING", logger="verity.trainer.async_rollout"):
        assert rollout.load_checkpoint(str(tmp_path)) == [{"in_flight_step": None}]
    assert "holds no batch in flight" in caplog.text and "on-policy" in caplog.text
    assert rollout.pending_step is None
