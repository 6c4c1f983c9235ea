"""``compute_advantages``: one entry point for every registered advantage estimator.

It checks the inputs (shapes, dtypes, and that the estimator's required inputs
were given) before any compute, then runs the estimator without autograd.
"""

from __future__ import annotations

import torch

# Importing the estimator modules registers them.
from verity.algorithms import advantages_group as _advantages_group  # noqa: F401
from verity.algorithms import advantages_returns as _advantages_returns  # noqa: F401
from verity.algorithms.advantages_base import AdvantageEstimatorSpec
from verity.algorithms.configs import AdvantageConfig
from verity.algorithms.registry import ADVANTAGE_ESTIMATORS
from verity.algorithms.tensor_checks import check_mask, check_per_sequence, check_token_tensor

Tensor = torch.Tensor


def estimators_needing(requirement: str) -> list[str]:
    """Names of the estimators with ``requirement`` (``"group"``, ``"values"``, ``"baseline_scores"``)."""
    attribute = f"needs_{requirement}"
    return [
        name for name in ADVANTAGE_ESTIMATORS.names() if getattr(ADVANTAGE_ESTIMATORS.get(name), attribute)
    ]


def compute_advantages(
    name: str,
    *,
    token_rewards: Tensor,
    response_mask: Tensor,
    group: Tensor | None = None,
    values: Tensor | None = None,
    config: AdvantageConfig | None = None,
    baseline_scores: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Compute ``(advantages, returns)`` with the estimator registered as ``name``.

    Args:
        name: estimator name (``gae``, ``grpo``, ``dr_grpo``, ``rloo``,
            ``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``, ``remax``,
            ``opo``, ``gpg``, ``grpo_passk`` or an alias).
        token_rewards: ``[B, R]`` float rewards per response token (outcome
            estimators use their sum over R as the sequence score).
        response_mask: ``[B, R]`` 1 on model tokens, 0 on padding / observations.
        group: ``[B]`` int64 prompt ids (required by group estimators).
        values: ``[B, R]`` critic values (required by ``gae``).
        config: estimator settings; defaults to ``AdvantageConfig()``.
        baseline_scores: ``[B]`` scores of the greedy rollouts (required by ``remax``).

    Returns:
        ``(advantages, returns)``, each ``[B, R]`` in ``token_rewards``' dtype,
        0 on masked-out tokens, without autograd history.
    """
    spec: AdvantageEstimatorSpec = ADVANTAGE_ESTIMATORS.get(name)
    config = AdvantageConfig() if config is None else config
    if not isinstance(config, AdvantageConfig):
        raise TypeError(f"config must be an AdvantageConfig, got {type(config).__name__}")
    config.validate()
    check_token_tensor("token_rewards", token_rewards)
    mask = check_mask("response_mask", response_mask, like=token_rewards)
    batch = token_rewards.shape[0]
    if group is None:
        if spec.needs_group:
            raise ValueError(
                f"advantage estimator {name!r} needs group ids (group [B] int64, the prompt index shared by "
                f"the samples of one prompt) but got group=None; estimators that need groups: "
                f"{', '.join(estimators_needing('group'))}"
            )
    else:
        check_per_sequence("group", group, batch, floating=False)
    if values is None:
        if spec.needs_values:
            raise ValueError(f"advantage estimator {name!r} needs critic values [B, R] but got values=None")
    else:
        check_token_tensor("values", values, like=token_rewards)
    if baseline_scores is None:
        if spec.needs_baseline_scores:
            raise ValueError(
                f"advantage estimator {name!r} needs baseline_scores [B] (the scores of greedy rollouts of "
                f"the same prompts) but got baseline_scores=None"
            )
    else:
        check_per_sequence("baseline_scores", baseline_scores, batch, floating=True)
    with torch.no_grad():
        advantages, returns = spec.fn(
            token_rewards=token_rewards.detach(),
            response_mask=mask,
            group=group,
            values=None if values is None else values.detach().to(token_rewards.dtype),
            baseline_scores=baseline_scores,
            config=config,
        )
    return advantages.to(token_rewards.dtype), returns.to(token_rewards.dtype)
