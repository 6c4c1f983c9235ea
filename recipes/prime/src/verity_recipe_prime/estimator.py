r"""The PRIME advantage: RLOO over outcome rewards plus the leave-one-out return of the
implicit process rewards (Cui et al. 2025, *Process Reinforcement through Implicit
Rewards*, arXiv:2502.01456, eq. 5).

For the :math:`K` samples of one prompt (a group :math:`g`, ``group [B]``), with
outcome scores :math:`s_i` (the verifier's, ``scores [B]``), process rewards
:math:`r_{i,t}` (the implicit PRM's, ``process_rewards [B, R]``), model-token mask
:math:`m_{i,t}` and :math:`L_i = \sum_t m_{i,t}`:

.. math::

    A^o_i &= s_i - \frac{1}{K-1}\sum_{j \in g,\, j \ne i} s_j
        && \text{(RLOO over outcomes)}\\
    \bar r_j &= \frac{1}{L_j}\sum_t m_{j,t}\, r_{j,t}
        && \text{(mean process reward of a response)}\\
    b_i &= \operatorname{mean}_{j \in g,\, j \ne i,\, L_j > 0}\ \bar r_j
        && \text{(leave-one-out process baseline)}\\
    A^p_{i,t} &= \sum_{s \ge t} \gamma^{k(t,s)}\, m_{i,s}\,(r_{i,s} - b_i)
        && \text{(return of the baselined process rewards)}\\
    A_{i,t} &= m_{i,t}\,\big(w_o A^o_i + w_p A^p_{i,t}\big)

:math:`k(t,s)` counts the model tokens after :math:`t` up to :math:`s`, so an
observation token (mask 0) inside a multi-turn response neither earns nor discounts
(the rule of :func:`verity.algorithms.advantages_returns.discounted_returns`); PRIME
uses :math:`\gamma = 1`, where :math:`A^p_{i,t}` is the plain return-to-go.
:math:`w_o`, :math:`w_p` are ``outcome_weight`` and ``process_weight``.

Options (both off in the paper's formula, both on in verl's PRIME recipe):
``process_reward_norm="max_abs_return"`` divides every process reward by
:math:`\max_{i,t} |\sum_{s \ge t} m_{i,s} r_{i,s}| + 10^{-6}` over the batch before
the baseline; ``whiten`` whitens the final advantages over the batch's model tokens.

Edges (the conventions of ``docs/algorithms.md``): a group of ONE sample gets 0 (no
baseline information, as for RLOO); when every outcome of a group is equal the
outcome term is exactly 0 (float64), the process term is not (that is PRIME's point:
dense credit where the outcome says nothing); a fully masked row gets 0 on every
token, its score still enters its group's outcome baseline, but it has no process
reward to average, so it is left out of the process baselines; a sample none of whose
group-mates has a model token gets process term 0 (no baseline information).

Returns are the un-whitened :math:`A_{i,t}` (the return of the baselined, weighted
rewards, as verl's recipe reports them; only a critic would read them).
"""

from __future__ import annotations

import torch
from verity.algorithms.advantages_base import group_stats
from verity.algorithms.advantages_returns import discounted_returns
from verity.algorithms.masked_ops import masked_whiten

Tensor = torch.Tensor

PROCESS_REWARD_NORMS = ("none", "max_abs_return")
NORM_EPS = 1e-6


def normalise_process_rewards(process_rewards: Tensor, response_mask: Tensor, mode: str) -> Tensor:
    r"""``none``: unchanged; ``max_abs_return``: divided by :math:`\max_{i,t}|G_{i,t}| + 10^{-6}`,
    :math:`G` the masked return-to-go (:math:`\gamma = 1`) of ``process_rewards`` over the batch.

    Shapes ``[B, R]``; the result is 0 on masked positions.
    """
    if mode not in PROCESS_REWARD_NORMS:
        raise ValueError(f"process_reward_norm must be one of {'|'.join(PROCESS_REWARD_NORMS)}, got {mode!r}")
    rewards = torch.where(response_mask > 0, process_rewards, torch.zeros_like(process_rewards))
    if mode == "none":
        return rewards
    returns = discounted_returns(rewards, response_mask, 1.0)
    return rewards / (returns.abs().max() + NORM_EPS)


def _check(outcome_scores: Tensor, process_rewards: Tensor, response_mask: Tensor, group: Tensor) -> None:
    if process_rewards.dim() != 2:
        raise ValueError(f"process_rewards must be [B, R], got shape {tuple(process_rewards.shape)}")
    batch = process_rewards.shape[0]
    if response_mask.shape != process_rewards.shape:
        raise ValueError(
            f"response_mask {tuple(response_mask.shape)} must have the shape of process_rewards "
            f"{tuple(process_rewards.shape)}"
        )
    for name, value in (("outcome_scores", outcome_scores), ("group", group)):
        if value.shape != (batch,):
            raise ValueError(f"{name} must be [B={batch}], got shape {tuple(value.shape)}")
    if group.is_floating_point():
        raise TypeError(f"group must hold integer prompt ids, got {group.dtype}")


def prime_advantages(
    *,
    outcome_scores: Tensor,
    process_rewards: Tensor,
    response_mask: Tensor,
    group: Tensor,
    outcome_weight: float = 1.0,
    process_weight: float = 1.0,
    gamma: float = 1.0,
    process_reward_norm: str = "none",
    whiten: bool = False,
    whiten_eps: float = 1e-8,
) -> tuple[Tensor, Tensor]:
    """PRIME advantages and returns (formulas in the module docstring).

    Args:
        outcome_scores: ``[B]`` verifier scores :math:`s_i`.
        process_rewards: ``[B, R]`` implicit process rewards :math:`r_{i,t}` (values on
            masked positions are ignored).
        response_mask: ``[B, R]`` 1 on model tokens.
        group: ``[B]`` integer prompt ids (the samples of one prompt share one).
        outcome_weight, process_weight: :math:`w_o`, :math:`w_p` (>= 0).
        gamma: discount of the process return, in [0, 1] (PRIME: 1).
        process_reward_norm: ``none`` | ``max_abs_return`` (see the module docstring).
        whiten: whiten the advantages over the batch's model tokens.
        whiten_eps: added to the variance when whitening.

    Returns:
        ``(advantages, returns)``, each ``[B, R]`` in ``process_rewards``' dtype, 0 on
        masked positions, without autograd history.
    """
    _check(outcome_scores, process_rewards, response_mask, group)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if outcome_weight < 0 or process_weight < 0:
        raise ValueError(f"weights must be >= 0, got outcome {outcome_weight}, process {process_weight}")
    with torch.no_grad():
        mask = (response_mask > 0).to(torch.float64)
        rewards = normalise_process_rewards(
            process_rewards.detach().to(torch.float64), mask, process_reward_norm
        )

        # outcome: leave-one-out over every sample of the group (fully masked rows included)
        scores = outcome_scores.detach().to(torch.float64)
        outcome = group_stats(scores, group)
        others = (outcome.count - 1).clamp(min=1.0)
        outcome_term = torch.where(outcome.count > 1, scores - (outcome.sum - scores) / others, 0.0)

        # process: leave-one-out over the mean process rewards of the group-mates with tokens
        lengths = mask.sum(-1)
        has_tokens = (lengths > 0).to(torch.float64)
        mean_reward = (rewards * mask).sum(-1) / lengths.clamp(min=1.0)
        sums = group_stats(mean_reward * has_tokens, group).sum
        counts = group_stats(has_tokens, group).sum
        other_sum = sums - mean_reward * has_tokens
        other_count = counts - has_tokens
        baseline = other_sum / other_count.clamp(min=1.0)
        process_return = discounted_returns((rewards - baseline.unsqueeze(-1)) * mask, mask, gamma)
        process_term = torch.where((other_count > 0).unsqueeze(-1), process_return, 0.0)

        combined = (outcome_weight * outcome_term.unsqueeze(-1) + process_weight * process_term) * mask
        advantages = masked_whiten(combined, mask, whiten_eps) if whiten else combined
    dtype = process_rewards.dtype if process_rewards.is_floating_point() else torch.float32
    return advantages.to(dtype), combined.to(dtype)


def prime_through_generic_entry_point(**_: object) -> tuple[Tensor, Tensor]:
    """Registered as ``prime`` so that ``algorithm.advantage.estimator: prime`` is a known name.

    The estimator needs the implicit PRM's process rewards, which the generic
    ``compute_advantages`` signature does not carry; runs compute it in the
    ``prime_advantage`` stage the recipe's planner installs. Calling it here is an error.
    """
    raise RuntimeError(
        "the 'prime' advantage estimator needs the implicit PRM's process rewards: it runs in the "
        "prime_advantage stage of verity-recipe-prime (verity_recipe_prime.estimator.prime_advantages), "
        "not through verity.algorithms.compute_advantages"
    )
