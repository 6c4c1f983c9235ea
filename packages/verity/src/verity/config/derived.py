"""Facts that follow from a run config: which optional roles and stages a run needs.

Used by the role registry (which worker groups to build) and the stage plan (which
stages to run), so both always agree.
"""

from __future__ import annotations

from typing import Any

__all__ = ["needs_baseline", "needs_critic", "needs_reference"]


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
