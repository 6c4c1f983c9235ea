"""GAE and REINFORCE++: hand-computed recursions, multi-turn masks, whitening."""

from __future__ import annotations

import math

import torch
from verity.algorithms import AdvantageConfig, compute_advantages, gae


def tensor(rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_gae_hand_computed():
    # gamma 0.9, lambda 0.8 -> gamma*lambda 0.72
    # t2: delta = 1 + 0 - 0.7 = 0.3                     A2 = 0.3
    # t1: delta = 0 + 0.9*0.7 - 0.6 = 0.03              A1 = 0.03 + 0.72*0.3 = 0.246
    # t0: delta = 0 + 0.9*0.6 - 0.5 = 0.04              A0 = 0.04 + 0.72*0.246 = 0.21712
    rewards = tensor([[0.0, 0.0, 1.0]])
    values = tensor([[0.5, 0.6, 0.7]])
    adv, ret = gae(rewards, values, torch.ones(1, 3), gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, tensor([[0.21712, 0.246, 0.3]]))
    torch.testing.assert_close(ret, tensor([[0.71712, 0.846, 1.0]]))


def test_gae_skips_observation_tokens_and_padding():
    # mask 1 0 0 1 0: an observation segment (t1, t2) and trailing padding (t4).
    # Rewards/values on masked positions are ignored (garbage on purpose).
    # t3: delta = 1 + 0.9*0 - 0.7 = 0.3                 A3 = 0.3
    # t0: next model token is t3: delta = 0 + 0.9*0.7 - 0.5 = 0.13, A0 = 0.13 + 0.72*0.3 = 0.346
    rewards = tensor([[0.0, 9.0, 0.0, 1.0, 0.0]])
    values = tensor([[0.5, 100.0, 100.0, 0.7, 100.0]])
    mask = tensor([[1, 0, 0, 1, 0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, tensor([[0.346, 0, 0, 0.3, 0]]))
    torch.testing.assert_close(ret, tensor([[0.846, 0, 0, 1.0, 0]]))
    # identical to the compacted sequence of model tokens only
    adv_c, ret_c = gae(tensor([[0.0, 1.0]]), tensor([[0.5, 0.7]]), torch.ones(1, 2), gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv[:, [0, 3]], adv_c)
    torch.testing.assert_close(ret[:, [0, 3]], ret_c)


def test_gae_lambda_one_gamma_one_is_return_minus_value():
    rewards = tensor([[0.0, 0.5, 1.0], [2.0, 0.0, 0.0]])
    values = tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    mask = tensor([[1, 1, 1], [1, 0, 0]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    # returns-to-go: row0 1.5, 1.5, 1.0; row1 2.0
    torch.testing.assert_close(ret, tensor([[1.5, 1.5, 1.0], [2.0, 0, 0]]))
    torch.testing.assert_close(adv, tensor([[1.4, 1.3, 0.7], [1.6, 0, 0]]))


def test_gae_estimator_whitens_by_default():
    rewards = tensor([[0.0, 0.0, 1.0]])
    values = tensor([[0.5, 0.6, 0.7]])
    config = AdvantageConfig(gamma=0.9, lam=0.8)
    adv, ret = compute_advantages(
        "gae", token_rewards=rewards, response_mask=torch.ones(1, 3), values=values, config=config
    )
    raw = [0.21712, 0.246, 0.3]
    mean = sum(raw) / 3
    var = sum((x - mean) ** 2 for x in raw) / 2
    torch.testing.assert_close(adv, tensor([[(x - mean) / math.sqrt(var + 1e-8) for x in raw]]))
    torch.testing.assert_close(ret, tensor([[0.71712, 0.846, 1.0]]))
    config = AdvantageConfig(gamma=0.9, lam=0.8, gae_whiten=False)
    adv, _ = compute_advantages(
        "gae", token_rewards=rewards, response_mask=torch.ones(1, 3), values=values, config=config
    )
    torch.testing.assert_close(adv, tensor([raw]))


def test_reinforce_plus_plus_hand_computed():
    # gamma 0.5. row0 returns: t2 1, t1 0.5, t0 0.25. row1 (t2 padding): t1 2, t0 1.
    # masked-in returns 0.25 0.5 1 1 2: mean 0.95, unbiased var 1.8 / 4 = 0.45
    rewards = tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = compute_advantages(
        "reinforce_plus_plus", token_rewards=rewards, response_mask=mask, config=AdvantageConfig(gamma=0.5)
    )
    torch.testing.assert_close(ret, tensor([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]))
    std = math.sqrt(0.45 + 1e-8)
    expected = tensor([[-0.7, -0.45, 0.05], [0.05, 1.05, 0.0]]) / std
    torch.testing.assert_close(adv, expected)


def test_reinforce_plus_plus_carries_return_through_observations():
    # mask 1 0 0 1: reward on an observation token (t2) is ignored; return crosses the gap.
    rewards = tensor([[0.0, 0.0, 5.0, 1.0]])
    mask = tensor([[1, 0, 0, 1]])
    _, ret = compute_advantages(
        "reinforce++", token_rewards=rewards, response_mask=mask, config=AdvantageConfig(gamma=0.5)
    )
    torch.testing.assert_close(ret, tensor([[0.5, 0.0, 0.0, 1.0]]))


def test_reinforce_plus_plus_edges():
    # all returns equal -> whitened advantages are 0; a single token -> 0; fully masked row -> 0
    rewards = tensor([[0.0, 1.0], [1.0, 0.0], [3.0, 3.0]])
    mask = tensor([[0, 1], [1, 0], [0, 0]])
    adv, ret = compute_advantages("reinforce++", token_rewards=rewards, response_mask=mask)
    torch.testing.assert_close(adv, torch.zeros(3, 2))
    torch.testing.assert_close(ret, tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 0.0]]))
    adv, _ = compute_advantages("reinforce++", token_rewards=tensor([[2.0]]), response_mask=torch.ones(1, 1))
    torch.testing.assert_close(adv, torch.zeros(1, 1))
