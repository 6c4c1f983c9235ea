r"""Outcome-reward advantage estimators (one scalar per sequence, broadcast over its tokens).

Common contract. Inputs: ``token_rewards [B, R]`` (float; the sequence score is
:math:`s_i = \sum_t r_{i,t}`, summed over ALL R positions), ``response_mask
[B, R]``, and for the group estimators ``group [B]`` (int ids; the n samples of
one prompt share an id). Output ``(advantages, returns)``, both ``[B, R]``: the
per-sequence advantage :math:`A_i` on every masked-in token, 0 on masked-out
tokens; ``returns`` is the sequence score :math:`s_i` broadcast the same way
(the Monte Carlo return of the whole response; only critic training uses it).

Edges, shared by every group estimator here (deliberate choice, see
``docs/algorithms.md``): a group of ONE sample has no baseline information and
gets advantage 0 (verl instead passes the raw score through); a group whose
scores are all equal gets 0; a fully masked row gets 0 on all of its tokens
but its score still counts in its group's statistics (its reward was observed),
except for OPO, where its length weight is 0.
"""

from __future__ import annotations

import torch

from verity.algorithms.advantages_base import (
    broadcast_over_tokens,
    group_stats,
    register_advantage_estimator,
    sequence_scores,
)
from verity.algorithms.configs import AdvantageConfig
from verity.algorithms.masked_ops import masked_whiten

Tensor = torch.Tensor


def _outcome(advantage: Tensor, scores: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    return broadcast_over_tokens(advantage, response_mask), broadcast_over_tokens(scores, response_mask)


@register_advantage_estimator("grpo", needs_group=True, reads=("norm_by_std", "eps"))
def grpo_advantages(
    *, token_rewards: Tensor, response_mask: Tensor, group: Tensor, config: AdvantageConfig, **_: object
) -> tuple[Tensor, Tensor]:
    r"""GRPO (Shao et al. 2024): group-normalised score.

    .. math::  A_i = \frac{s_i - \mu_g}{\sigma_g + \varepsilon}
               \quad(\text{or } s_i - \mu_g \text{ when norm\_by\_std is False})

    :math:`\mu_g`, :math:`\sigma_g`: mean and unbiased (n-1) std of the scores of
    sample i's group g; :math:`\varepsilon` = ``config.eps`` (1e-6). Groups of
    one -> 0. Shapes: see the module docstring.
    """
    scores = sequence_scores(token_rewards)
    stats = group_stats(scores, group)
    advantage = scores.to(torch.float64) - stats.mean
    if config.norm_by_std:
        advantage = advantage / (stats.std + config.eps)
    advantage = torch.where(stats.count > 1, advantage, torch.zeros_like(advantage))
    return _outcome(advantage, scores, response_mask)


@register_advantage_estimator("dr_grpo", "drgrpo", needs_group=True, reads=())
def dr_grpo_advantages(
    *, token_rewards: Tensor, response_mask: Tensor, group: Tensor, config: AdvantageConfig, **_: object
) -> tuple[Tensor, Tensor]:
    r"""Dr. GRPO (Liu et al. 2025): group-mean baseline, no std normalisation.

    .. math::  A_i = s_i - \mu_g

    ``config.norm_by_std`` is ignored. Pair with the ``seq-mean-token-sum-norm``
    aggregation to get the paper's full objective.
    """
    scores = sequence_scores(token_rewards)
    stats = group_stats(scores, group)
    advantage = scores.to(torch.float64) - stats.mean
    advantage = torch.where(stats.count > 1, advantage, torch.zeros_like(advantage))
    return _outcome(advantage, scores, response_mask)


@register_advantage_estimator("rloo", needs_group=True, reads=())
def rloo_advantages(
    *, token_rewards: Tensor, response_mask: Tensor, group: Tensor, config: AdvantageConfig, **_: object
) -> tuple[Tensor, Tensor]:
    r"""RLOO (Kool et al. 2019; Ahmadian et al. 2024): leave-one-out baseline.

    .. math::  A_i = s_i - \frac{1}{n_g - 1}\sum_{j \in g, j \ne i} s_j
               = \frac{n_g}{n_g - 1}(s_i - \mu_g)

    Groups of one (no other sample) -> 0.
    """
    scores = sequence_scores(token_rewards)
    stats = group_stats(scores, group)
    x = scores.to(torch.float64)
    others_mean = (stats.sum - x) / (stats.count - 1).clamp(min=1.0)
    advantage = torch.where(stats.count > 1, x - others_mean, torch.zeros_like(x))
    return _outcome(advantage, scores, response_mask)


@register_advantage_estimator(
    "reinforce_plus_plus_baseline",
    "reinforce++_baseline",
    "reinforce++-baseline",
    needs_group=True,
    reads=("whiten_eps",),
)
def reinforce_plus_plus_baseline_advantages(
    *, token_rewards: Tensor, response_mask: Tensor, group: Tensor, config: AdvantageConfig, **_: object
) -> tuple[Tensor, Tensor]:
    r"""REINFORCE++ with baseline (Hu 2025): group-mean baseline, then batch whitening.

    .. math::  a_{i,t} = (s_i - \mu_g)\,m_{i,t},\qquad
               A_{i,t} = \frac{a_{i,t} - \bar a}{\sqrt{\operatorname{var}(a) + \varepsilon_w}}

    :math:`\bar a`, :math:`\operatorname{var}(a)`: mean and unbiased variance over
    all masked-in tokens of the batch (token-weighted); :math:`\varepsilon_w` =
    ``config.whiten_eps``. Groups of one give :math:`a = 0` before whitening
    (not exactly 0 after it, since whitening shifts by the batch mean).
    """
    scores = sequence_scores(token_rewards)
    stats = group_stats(scores, group)
    centered = torch.where(
        stats.count > 1, scores.to(torch.float64) - stats.mean, torch.zeros_like(stats.mean)
    )
    per_token = broadcast_over_tokens(centered, response_mask)
    return masked_whiten(per_token, response_mask, config.whiten_eps), broadcast_over_tokens(
        scores, response_mask
    )


@register_advantage_estimator("remax", needs_baseline_scores=True, reads=())
def remax_advantages(
    *, token_rewards: Tensor, response_mask: Tensor, baseline_scores: Tensor, **_: object
) -> tuple[Tensor, Tensor]:
    r"""ReMax (Li et al. 2023): baseline = score of a greedy rollout of the same prompt.

    .. math::  A_i = s_i - b_i, \qquad b_i = r(x_i, \hat y_i^{\text{greedy}})

    ``baseline_scores [B]`` holds :math:`b_i` (the trainer decodes greedily and
    scores it). No groups needed; there is no group edge.
    """
    scores = sequence_scores(token_rewards)
    advantage = scores.to(torch.float64) - baseline_scores.to(torch.float64)
    return _outcome(advantage, scores, response_mask)


@register_advantage_estimator("opo", needs_group=True, reads=())
def opo_advantages(
    *, token_rewards: Tensor, response_mask: Tensor, group: Tensor, config: AdvantageConfig, **_: object
) -> tuple[Tensor, Tensor]:
    r"""OPO (Hao et al. 2025): length-weighted group baseline (the optimal baseline
    under the approximation :math:`\|\nabla\log\pi(y)\|^2 \propto |y|`).

    .. math::  A_i = s_i - \frac{\sum_{j\in g} \ell_j s_j}{\sum_{j\in g} \ell_j},
               \qquad \ell_j = \sum_t m_{j,t}

    A group of one gives 0 (its baseline is its own score); a group whose
    lengths are all 0 gives 0; fully masked rows have weight 0.
    """
    scores = sequence_scores(token_rewards)
    lengths = response_mask.sum(dim=-1).to(torch.float64)
    x = scores.to(torch.float64)
    weighted = group_stats(lengths * x, group)
    by_length = group_stats(lengths, group)
    has_weight = by_length.sum > 0
    baseline = weighted.sum / by_length.sum.clamp(min=1e-12)
    advantage = torch.where(has_weight & (by_length.count > 1), x - baseline, torch.zeros_like(x))
    return _outcome(advantage, scores, response_mask)


@register_advantage_estimator(
    "gpg", needs_group=True, reads=("gpg_norm_by_std", "gpg_alpha_correction", "eps")
)
def gpg_advantages(
    *, token_rewards: Tensor, response_mask: Tensor, group: Tensor, config: AdvantageConfig, **_: object
) -> tuple[Tensor, Tensor]:
    r"""GPG (Chu et al. 2025): group-mean baseline with the batch correction :math:`\alpha`.

    .. math::  A_i = \alpha\,\frac{s_i - \mu_g}{F}, \qquad \alpha = \frac{B}{B - M}

    :math:`B`: batch size; :math:`M`: number of samples whose group's scores are
    all equal (their advantage is exactly 0, including groups of one), so
    :math:`\alpha` rescales the gradient to the samples that carry signal
    (:math:`\alpha = 1` when :math:`M = B`, or when ``gpg_alpha_correction`` is
    False). :math:`F = \sigma_g + \varepsilon` if ``gpg_norm_by_std`` else 1
    (the paper's default).
    """
    scores = sequence_scores(token_rewards)
    stats = group_stats(scores, group)
    advantage = scores.to(torch.float64) - stats.mean
    if config.gpg_norm_by_std:
        advantage = advantage / (stats.std + config.eps)
    degenerate = (stats.max == stats.min) | (stats.count < 2)
    advantage = torch.where(degenerate, torch.zeros_like(advantage), advantage)
    batch = scores.shape[0]
    num_degenerate = int(degenerate.sum().item())
    if config.gpg_alpha_correction and num_degenerate < batch:
        advantage = advantage * (batch / (batch - num_degenerate))
    return _outcome(advantage, scores, response_mask)


@register_advantage_estimator("grpo_passk", "grpo_pass@k", needs_group=True, reads=("norm_by_std", "eps"))
def grpo_passk_advantages(
    *, token_rewards: Tensor, response_mask: Tensor, group: Tensor, config: AdvantageConfig, **_: object
) -> tuple[Tensor, Tensor]:
    r"""GRPO pass@k (Tang et al. 2025), k = group size: leave-one-out estimator of
    :math:`\nabla\,\mathbb{E}[\max_{j\in g} s_j]`.

    .. math::  A_i = \frac{\max_{j\in g} s_j - \max_{j\in g, j\ne i} s_j}{\sigma_g + \varepsilon}

    Only a group's unique best sample gets a non-zero advantage (best minus
    second best); tied best samples get 0. Division by
    :math:`\sigma_g + \varepsilon` only when ``norm_by_std`` (verl's convention;
    the paper does not normalise). Groups of one -> 0.
    """
    scores = sequence_scores(token_rewards)
    stats = group_stats(scores, group)
    x = scores.to(torch.float64)
    is_max = x == stats.max
    # Max over the group after removing every sample equal to the max: the second best value.
    below_max = torch.where(is_max, torch.full_like(x, float("-inf")), x)
    second = torch.full((stats.num_groups,), float("-inf"), dtype=torch.float64, device=x.device)
    second = second.scatter_reduce(0, stats.inverse, below_max, reduce="amax")[stats.inverse]
    num_at_max = torch.zeros(stats.num_groups, dtype=torch.float64, device=x.device)
    num_at_max = num_at_max.index_add(0, stats.inverse, is_max.to(torch.float64))[stats.inverse]
    unique_best = is_max & (num_at_max == 1) & (stats.count > 1)
    gap = torch.where(unique_best, stats.max - second, torch.zeros_like(x))
    if config.norm_by_std:
        gap = gap / (stats.std + config.eps)
    return _outcome(gap, scores, response_mask)
