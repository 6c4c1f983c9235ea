"""Where the PPO ratio's behaviour log-probs come from, and that skipping the recomputation changes no gradient."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import make_padded_batch, tiny_qwen2
from verity.algorithms.configs import KLConfig, PolicyLossConfig
from verity.config import ConfigError, load_config
from verity.config.derived import old_logprobs_source
from verity.engines import FSDP2Engine, OptimConfig
from verity.workers.actor_rollout import make_actor_loss


def _grads(engine: FSDP2Engine, batch: dict, loss_fn) -> dict[str, torch.Tensor]:
    metrics = engine.forward_backward(batch, loss_fn, 3)
    grads = engine.full_gradients()
    engine.optimizer.zero_grad(set_to_none=True)
    return grads, metrics


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_on_policy_update_without_recomputed_old_logprobs_has_the_same_gradient(agg) -> None:
    engine = FSDP2Engine(tiny_qwen2(seed=3), OptimConfig(lr=1e-2))
    batch = make_padded_batch(rows=7, seed=5)
    loss_fn = make_actor_loss(PolicyLossConfig(loss_agg_mode=agg), KLConfig(), 0.0)
    old, _ = engine.compute_logprobs(batch, 4)  # what the old_log_prob stage computes
    recomputed, m_re = _grads(engine, {**batch, "old_logprobs": old}, loss_fn)
    skipped, m_skip = _grads(engine, batch, loss_fn)
    assert set(recomputed) == set(skipped) and len(skipped) > 10
    assert any(g.abs().max() > 1e-4 for g in skipped.values())
    for name, grad in skipped.items():
        torch.testing.assert_close(grad, recomputed[name], rtol=1e-5, atol=1e-8, msg=name)
    assert m_skip["actor/behaviour_logprob_gap"] == 0.0
    assert m_re["actor/behaviour_logprob_gap"] < 1e-5  # the recomputation equals the forward's own
    # a behaviour policy that is not the current one changes the gradient: the test can tell
    shifted, _ = _grads(engine, {**batch, "old_logprobs": old - 0.1}, loss_fn)
    assert any(not torch.allclose(shifted[n], skipped[n], rtol=1e-3) for n in skipped)


def test_the_source_follows_the_config() -> None:
    assert old_logprobs_source(load_config([])) == "policy"  # one epoch, one mini-batch: on-policy
    assert old_logprobs_source(load_config(["actor.ppo_epochs=2"])) == "recompute"
    assert old_logprobs_source(load_config(["actor.ppo_mini_batch_size=16"])) == "recompute"
    assert old_logprobs_source(load_config(["algorithm.kl.use_kl_in_reward=true"])) == "recompute"
    assert old_logprobs_source(load_config(["actor.old_logprobs=recompute"])) == "recompute"
    assert old_logprobs_source(load_config(["actor.old_logprobs=rollout"])) == "rollout"
    with pytest.raises(ConfigError, match="actor.old_logprobs must be one of auto|recompute|rollout"):
        load_config(["actor.old_logprobs=sometimes"])
    with pytest.raises(ConfigError, match="KL in the reward needs the trainer's own log-probs"):
        load_config(["actor.old_logprobs=rollout", "algorithm.kl.use_kl_in_reward=true"])
