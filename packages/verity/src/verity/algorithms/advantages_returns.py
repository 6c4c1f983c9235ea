r"""Token-level estimators built on a backward recursion: GAE and REINFORCE++.

Masks that skip non-model tokens. In multi-turn rollouts the response holds
tool/environment observation tokens (mask 0) between model turns. The
recursions run over MODEL tokens only: at a masked position the running
quantities (next value, running advantage, running return) are carried through
unchanged, so the chain links the last model token before an observation to
the first model token after it, with one step of discount between them. Rewards
and values sitting on masked positions are ignored. Trailing padding is the
same rule with nothing after it.
"""

from __future__ import annotations

import torch

from verity.algorithms.advantages_base import register_advantage_estimator
from verity.algorithms.configs import AdvantageConfig
from verity.algorithms.masked_ops import masked_whiten

Tensor = torch.Tensor


def gae(
    token_rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    r"""Generalised advantage estimation (Schulman et al. 2015) over model tokens.

    With :math:`t' = ` the next model token after :math:`t` (none: :math:`V_{t'} = 0,
    A_{t'} = 0`):

    .. math::  \delta_t = r_t + \gamma V_{t'} - V_t,\qquad A_t = \delta_t + \gamma\lambda A_{t'},
               \qquad G_t = A_t + V_t

    Args:
        token_rewards, values, response_mask: ``[B, R]``.
        gamma, lam: discount and GAE lambda.

    Returns:
        ``(advantages, returns)`` ``[B, R]``, not whitened, 0 on masked positions.
    """
    batch, length = token_rewards.shape
    next_value = torch.zeros(batch, dtype=token_rewards.dtype, device=token_rewards.device)
    running = torch.zeros_like(next_value)
    advantages = torch.zeros_like(token_rewards)
    keep = response_mask > 0
    for t in reversed(range(length)):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * running
        running = torch.where(keep[:, t], step, running)
        next_value = torch.where(keep[:, t], values[:, t], next_value)
        advantages[:, t] = running
    zero = torch.zeros_like(advantages)
    returns = torch.where(keep, advantages + values, zero)
    return torch.where(keep, advantages, zero), returns


def discounted_returns(token_rewards: Tensor, response_mask: Tensor, gamma: float) -> Tensor:
    r"""Discounted return-to-go over model tokens, ``[B, R]``, 0 on masked positions.

    .. math::  G_t = r_t + \gamma G_{t'}
    """
    batch, length = token_rewards.shape
    running = torch.zeros(batch, dtype=token_rewards.dtype, device=token_rewards.device)
    returns = torch.zeros_like(token_rewards)
    keep = response_mask > 0
    for t in reversed(range(length)):
        running = torch.where(keep[:, t], token_rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return torch.where(keep, returns, torch.zeros_like(returns))


@register_advantage_estimator("gae", needs_values=True, reads=("gamma", "lam", "gae_whiten", "whiten_eps"))
def gae_advantages(
    *, token_rewards: Tensor, response_mask: Tensor, values: Tensor, config: AdvantageConfig, **_: object
) -> tuple[Tensor, Tensor]:
    r"""GAE advantages for PPO with a critic (see :func:`gae`), optionally whitened.

    When ``config.gae_whiten`` (default, the usual PPO practice) the advantages
    are whitened over all masked-in tokens of the batch:
    :math:`(A - \bar A)/\sqrt{\operatorname{var}(A) + \varepsilon_w}` (unbiased
    variance). Returns are computed from the un-whitened advantages.
    """
    advantages, returns = gae(token_rewards, values, response_mask, config.gamma, config.lam)
    if config.gae_whiten:
        advantages = masked_whiten(advantages, response_mask, config.whiten_eps)
    return advantages, returns


@register_advantage_estimator("reinforce_plus_plus", "reinforce++", reads=("gamma", "whiten_eps"))
def reinforce_plus_plus_advantages(
    *, token_rewards: Tensor, response_mask: Tensor, config: AdvantageConfig, **_: object
) -> tuple[Tensor, Tensor]:
    r"""REINFORCE++ (Hu 2025): discounted return, whitened over the batch.

    .. math::  G_t = r_t + \gamma G_{t'},\qquad
               A_t = \frac{G_t - \bar G}{\sqrt{\operatorname{var}(G) + \varepsilon_w}}

    Mean and unbiased variance over all masked-in tokens of the batch. The token
    rewards usually carry the per-token KL penalty (``apply_kl_penalty``). No
    groups: a batch of one token gives 0; a batch whose returns are all equal
    gives 0. Returns: :math:`G_t`.
    """
    returns = discounted_returns(token_rewards, response_mask, config.gamma)
    return masked_whiten(returns, response_mask, config.whiten_eps), returns
