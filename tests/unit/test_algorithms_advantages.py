"""Outcome-reward advantage estimators: hand-computed cases and edges.

Shared batch (B=6, R=3). The score of a row is the sum of its token rewards
(a reward on a masked position still counts, as for row 2):

    row  group  mask     score  length
    0    7      1 1 0    1      2
    1    7      1 1 1    4      3
    2    7      0 0 0    1      0      <- fully masked row
    3    3      1 0 0    5      1      } group 3: all rewards equal
    4    3      1 1 0    5      2      }
    5    9      1 1 1    4      3      <- group of one

Group 7: scores 1, 4, 1 -> mean 2, deviations -1, 2, -1,
unbiased var (1 + 4 + 1) / 2 = 3, std sqrt(3).
"""

from __future__ import annotations

import math

import pytest
import torch
from verity.algorithms import AdvantageConfig, compute_advantages

EPS = 1e-6
SQRT3 = math.sqrt(3.0)


def tensor(rows):
    return torch.tensor(rows, dtype=torch.float32)


@pytest.fixture
def batch():
    token_rewards = tensor(
        [
            [0.0, 1.0, 0.0],
            [0.0, 0.0, 4.0],
            [1.0, 0.0, 0.0],
            [5.0, 0.0, 0.0],
            [0.0, 5.0, 0.0],
            [0.0, 0.0, 4.0],
        ]
    )
    mask = tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0], [1, 0, 0], [1, 1, 0], [1, 1, 1]])
    group = torch.tensor([7, 7, 7, 3, 3, 9], dtype=torch.int64)
    return token_rewards, mask, group


def per_seq(values, mask):
    """Expected [B, R]: value of row i on its masked-in tokens."""
    return tensor(values).unsqueeze(-1) * mask


def run(name, batch, **config):
    token_rewards, mask, group = batch
    return compute_advantages(
        name, token_rewards=token_rewards, response_mask=mask, group=group, config=AdvantageConfig(**config)
    )


def expected_returns(mask):
    return per_seq([1, 4, 1, 5, 5, 4], mask)


def test_grpo_normalised_by_unbiased_std(batch):
    adv, ret = run("grpo", batch)
    mask = batch[1]
    # group 7: (-1, 2) / (sqrt 3 + eps); group 3 all equal -> 0; group 9 single -> 0
    expected = per_seq([-1 / (SQRT3 + EPS), 2 / (SQRT3 + EPS), 0, 0, 0, 0], mask)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected_returns(mask))
    assert adv.dtype == torch.float32


def test_grpo_without_std(batch):
    adv, _ = run("grpo", batch, norm_by_std=False)
    torch.testing.assert_close(adv, per_seq([-1, 2, 0, 0, 0, 0], batch[1]))


def test_dr_grpo_ignores_norm_by_std(batch):
    adv, _ = run("dr_grpo", batch, norm_by_std=True)
    torch.testing.assert_close(adv, per_seq([-1, 2, 0, 0, 0, 0], batch[1]))


def test_rloo_leave_one_out(batch):
    adv, _ = run("rloo", batch)
    # row 0: 1 - (4 + 1)/2 = -1.5; row 1: 4 - (1 + 1)/2 = 3
    torch.testing.assert_close(adv, per_seq([-1.5, 3, 0, 0, 0, 0], batch[1]))


def test_opo_length_weighted_baseline(batch):
    adv, _ = run("opo", batch)
    # group 7 baseline (2*1 + 3*4 + 0*1) / (2 + 3 + 0) = 2.8; group 3 baseline 5; group 9 single
    torch.testing.assert_close(adv, per_seq([1 - 2.8, 4 - 2.8, 0, 0, 0, 0], batch[1]))


def test_gpg_alpha_correction(batch):
    adv, _ = run("gpg", batch)
    # M = 3 samples in degenerate groups (group 3 equal, group 9 single); alpha = 6 / (6 - 3) = 2
    torch.testing.assert_close(adv, per_seq([-2, 4, 0, 0, 0, 0], batch[1]))
    adv, _ = run("gpg", batch, gpg_alpha_correction=False)
    torch.testing.assert_close(adv, per_seq([-1, 2, 0, 0, 0, 0], batch[1]))
    adv, _ = run("gpg", batch, gpg_norm_by_std=True)
    torch.testing.assert_close(adv, per_seq([-2 / (SQRT3 + EPS), 4 / (SQRT3 + EPS), 0, 0, 0, 0], batch[1]))


def test_gpg_all_groups_degenerate_gives_zero():
    rewards = tensor([[1.0], [1.0], [0.0]])
    adv, _ = compute_advantages(
        "gpg",
        token_rewards=rewards,
        response_mask=torch.ones(3, 1),
        group=torch.tensor([0, 0, 1]),
    )
    torch.testing.assert_close(adv, torch.zeros(3, 1))


def test_grpo_passk_best_minus_second_best(batch):
    adv, _ = run("grpo_passk", batch, norm_by_std=False)
    # group 7: unique best row 1 (4) minus second best (1) = 3; group 3 tied best -> 0; single -> 0
    torch.testing.assert_close(adv, per_seq([0, 3, 0, 0, 0, 0], batch[1]))
    adv, _ = run("grpo_passk", batch)
    torch.testing.assert_close(adv, per_seq([0, 3 / (SQRT3 + EPS), 0, 0, 0, 0], batch[1]))


def test_grpo_passk_tied_best_gets_zero():
    rewards = tensor([[2.0], [2.0], [1.0], [0.0], [3.0], [1.0]])
    adv, _ = compute_advantages(
        "grpo_passk",
        token_rewards=rewards,
        response_mask=torch.ones(6, 1),
        group=torch.tensor([0, 0, 0, 1, 1, 1]),
        config=AdvantageConfig(norm_by_std=False),
    )
    # group 0: best tied -> all 0; group 1: best 3, second 1 -> 2 on row 4
    torch.testing.assert_close(adv, tensor([[0.0], [0.0], [0.0], [0.0], [2.0], [0.0]]))


def test_reinforce_plus_plus_baseline_whitens_over_tokens(batch):
    adv, _ = run("reinforce_plus_plus_baseline", batch)
    mask = batch[1]
    # centred per-token values over the 11 masked-in tokens:
    # row0 -1,-1; row1 2,2,2; row3 0; row4 0,0; row5 0,0,0 (group of one -> 0)
    mean = 4 / 11
    var = (14 - 11 * mean**2) / 10  # unbiased: (sum x^2 - N mean^2) / (N - 1) = 138/110
    std = math.sqrt(var + 1e-8)
    z = (0 - mean) / std
    expected = per_seq([(-1 - mean) / std, (2 - mean) / std, 0, z, z, z], mask)
    torch.testing.assert_close(adv, expected)


def test_remax_uses_greedy_baseline(batch):
    token_rewards, mask, _ = batch
    baseline = torch.tensor([0.5, 4.0, 2.0, 5.0, 6.0, 1.0])
    adv, ret = compute_advantages(
        "remax", token_rewards=token_rewards, response_mask=mask, baseline_scores=baseline
    )
    torch.testing.assert_close(adv, per_seq([0.5, 0.0, -1.0, 0.0, -1.0, 3.0], mask))
    torch.testing.assert_close(ret, expected_returns(mask))


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "opo", "gpg", "grpo_passk"])
def test_edges_single_sample_equal_rewards_and_masked_rows(batch, name):
    adv, ret = run(name, batch)
    mask = batch[1]
    assert torch.all(adv[2] == 0), "fully masked row must have zero advantages"
    assert torch.all(adv[3:] == 0), "equal-reward group and group of one must have zero advantages"
    assert torch.all(adv[mask == 0] == 0) and torch.all(ret[mask == 0] == 0)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "opo", "gpg", "grpo_passk"])
def test_group_ids_need_not_be_contiguous_or_sorted(batch, name):
    token_rewards, mask, group = batch
    perm = torch.tensor([4, 0, 5, 2, 1, 3])
    adv, _ = run(name, batch)
    adv_perm, _ = compute_advantages(
        name, token_rewards=token_rewards[perm], response_mask=mask[perm], group=group[perm]
    )
    torch.testing.assert_close(adv_perm, adv[perm])


def test_multi_turn_mask_broadcast_zeroes_observation_tokens():
    # one row with an observation segment (mask 0) inside the response
    rewards = tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    mask = tensor([[1, 0, 0, 1], [1, 1, 1, 1]])
    adv, _ = compute_advantages(
        "grpo",
        token_rewards=rewards,
        response_mask=mask,
        group=torch.tensor([0, 0]),
        config=AdvantageConfig(),
    )
    # scores 1, 0 -> mean 0.5, std sqrt(0.5)
    a = 0.5 / (math.sqrt(0.5) + EPS)
    torch.testing.assert_close(adv, tensor([[a, 0, 0, a], [-a, -a, -a, -a]]))


def test_advantages_carry_no_grad():
    rewards = torch.tensor([[1.0], [0.0]], requires_grad=True)
    adv, ret = compute_advantages(
        "grpo", token_rewards=rewards, response_mask=torch.ones(2, 1), group=torch.tensor([0, 0])
    )
    assert not adv.requires_grad and not ret.requires_grad
