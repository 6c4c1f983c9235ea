"""verity.algorithms: pure tensor functions behind name registries.

Advantage estimators, policy losses, the value loss, KL estimators and
controllers, entropy, and loss aggregation normalised over the whole global
batch. Formulas, papers and edge behaviour: ``docs/algorithms.md``; each
function's docstring carries its formula too.

Tensor layout (verl's): per-token tensors are ``[B, R]`` over the response
positions, with ``response_mask [B, R]`` 1 on model tokens; ``group [B]`` int64
prompt ids; ``scores``/``baseline_scores`` ``[B]``.
"""

from __future__ import annotations

from verity.algorithms.advantages import compute_advantages, estimators_needing
from verity.algorithms.advantages_base import (
    AdvantageEstimatorSpec,
    group_stats,
    register_advantage_estimator,
)
from verity.algorithms.advantages_returns import discounted_returns, gae
from verity.algorithms.aggregation import AggregationContext, aggregate_loss
from verity.algorithms.configs import (
    AdvantageConfig,
    EntropyConfig,
    KLConfig,
    PolicyLossConfig,
    ValueLossConfig,
)
from verity.algorithms.entropy import entropy_bonus, entropy_from_logits
from verity.algorithms.kl import kl_loss, kl_penalty, straight_through
from verity.algorithms.kl_control import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    build_kl_controller,
)
from verity.algorithms.masked_ops import masked_mean, masked_sum, masked_whiten
from verity.algorithms.policy_losses import get_policy_loss
from verity.algorithms.registry import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATION_MODES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    Registry,
    UnknownNameError,
)
from verity.algorithms.value_loss import value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATION_MODES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AdvantageConfig",
    "AdvantageEstimatorSpec",
    "AggregationContext",
    "EntropyConfig",
    "FixedKLController",
    "KLConfig",
    "PolicyLossConfig",
    "Registry",
    "UnknownNameError",
    "ValueLossConfig",
    "aggregate_loss",
    "apply_kl_penalty",
    "build_kl_controller",
    "compute_advantages",
    "discounted_returns",
    "entropy_bonus",
    "entropy_from_logits",
    "estimators_needing",
    "gae",
    "get_policy_loss",
    "group_stats",
    "kl_loss",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "register_advantage_estimator",
    "straight_through",
    "value_loss",
]
