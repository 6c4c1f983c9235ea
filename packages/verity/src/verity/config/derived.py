"""Facts that follow from a run config: which optional roles and stages a run needs.

Used by the role registry (which worker groups to build) and the stage plan (which
stages to run), so both always agree.
"""

from __future__ import annotations

from typing import Any

__all__ = ["needs_baseline", "needs_critic", "needs_reference", "old_logprobs_source", "on_policy"]

OLD_LOGPROBS_MODES = ("auto", "recompute", "rollout")


def needs_reference(cfg: Any) -> bool:
    """Whether any KL term needs the reference policy's log-probs."""
    return bool(cfg.algorithm.kl.use_kl_loss or cfg.algorithm.kl.use_kl_in_reward)


def needs_critic(cfg: Any) -> bool:
    """Whether the run has a critic: ``critic.enabled``, or (auto) an estimator that needs values."""
    from verity.algorithms.advantages import estimators_needing

    if cfg.critic.enabled is not None:
        return bool(cfg.critic.enabled)
    return cfg.algorithm.advantage.estimator in estimators_needing("values")


def needs_baseline(cfg: Any) -> bool:
    """Whether the estimator needs ``baseline_scores`` (ReMax's greedy rollouts)."""
    from verity.algorithms.advantages import estimators_needing

    return cfg.algorithm.advantage.estimator in estimators_needing("baseline_scores")


def on_policy(cfg: Any) -> bool:
    """Whether the actor takes exactly one optimizer step per RL step (one epoch, one mini-batch).

    Then every sample is trained on by the policy that generated it, before any update.
    """
    return cfg.actor.ppo_epochs == 1 and cfg.data.train_batch_size == cfg.actor.ppo_mini_batch_size


def old_logprobs_source(cfg: Any) -> str:
    """Where the behaviour log-probs of the PPO ratio come from this run: ``recompute`` | ``rollout`` | ``policy``.

    ``policy``: the update's own forward, detached (``actor.old_logprobs=auto`` in an on-policy
    run without KL in the reward, which reads them before the update): the ratio is 1 and its
    gradient the policy gradient, exactly what a recomputation would give, without the extra
    forward. ``recompute``: a forward pass before the update. ``rollout``: the sampler's own
    log-probs (``rollout_logprobs``), no forward; the gap to the trainer's is logged.
    """
    mode = cfg.actor.old_logprobs
    if mode != "auto":
        return mode
    if on_policy(cfg) and not cfg.algorithm.kl.use_kl_in_reward:
        return "policy"
    return "recompute"
