"""The PRIME advantage against values computed by hand (docs/algorithms.md, "PRIME")."""

from __future__ import annotations

import pytest
import torch
from verity.algorithms.masked_ops import masked_whiten
from verity_recipe_prime.estimator import normalise_process_rewards, prime_advantages

X = 9.9  # a value on a masked position: must be ignored


def _three_samples():
    """One group of 3: lengths 3, 2, 1; outcomes 1, 0, 1; mean process rewards 0.1, 0.2, -0.6."""
    rewards = torch.tensor([[0.1, -0.2, 0.4], [0.3, 0.1, X], [-0.6, X, X]])
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 0, 0]])
    return torch.tensor([1.0, 0.0, 1.0]), rewards, mask, torch.tensor([7, 7, 7])


def test_outcome_rloo_plus_leave_one_out_process_return_by_hand() -> None:
    scores, rewards, mask, group = _three_samples()
    adv, ret = prime_advantages(
        outcome_scores=scores, process_rewards=rewards, response_mask=mask, group=group,
        outcome_weight=1.0, process_weight=2.0,
    )  # fmt: skip
    # outcome RLOO: 1 - (0+1)/2 = 0.5, 0 - (1+1)/2 = -1, 1 - (1+0)/2 = 0.5
    # process baselines: b0 = (0.2-0.6)/2 = -0.2, b1 = (0.1-0.6)/2 = -0.25, b2 = (0.1+0.2)/2 = 0.15
    # baselined rewards: [0.3, 0.0, 0.6], [0.55, 0.35], [-0.75] -> returns-to-go below
    want = torch.tensor(
        [
            [0.5 + 2 * 0.9, 0.5 + 2 * 0.6, 0.5 + 2 * 0.6],
            [-1.0 + 2 * 0.9, -1.0 + 2 * 0.35, 0.0],
            [0.5 + 2 * -0.75, 0.0, 0.0],
        ]
    )
    torch.testing.assert_close(adv, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(ret, want, rtol=0, atol=1e-6)  # un-whitened: the same


def test_each_weight_scales_its_own_term() -> None:
    scores, rewards, mask, group = _three_samples()
    outcome, _ = prime_advantages(
        outcome_scores=scores, process_rewards=rewards, response_mask=mask, group=group, process_weight=0.0
    )
    process, _ = prime_advantages(
        outcome_scores=scores, process_rewards=rewards, response_mask=mask, group=group, outcome_weight=0.0
    )
    torch.testing.assert_close(outcome, torch.tensor([[0.5] * 3, [-1.0, -1.0, 0.0], [0.5, 0.0, 0.0]]))
    torch.testing.assert_close(process, torch.tensor([[0.9, 0.6, 0.6], [0.9, 0.35, 0.0], [-0.75, 0.0, 0.0]]))
    both, _ = prime_advantages(
        outcome_scores=scores, process_rewards=rewards, response_mask=mask, group=group,
        outcome_weight=3.0, process_weight=0.5,
    )  # fmt: skip
    torch.testing.assert_close(both, 3.0 * outcome + 0.5 * process)


def test_discounted_process_return() -> None:
    scores, rewards, mask, group = _three_samples()
    adv, _ = prime_advantages(
        outcome_scores=scores, process_rewards=rewards, response_mask=mask, group=group,
        outcome_weight=0.0, gamma=0.5,
    )  # fmt: skip
    # row 0 baselined [0.3, 0.0, 0.6]: G2 = 0.6, G1 = 0 + 0.5*0.6 = 0.3, G0 = 0.3 + 0.5*0.3 = 0.45
    torch.testing.assert_close(adv[0], torch.tensor([0.45, 0.3, 0.6]))


def test_groups_are_found_by_id_not_by_position() -> None:
    scores, rewards, mask, group = _three_samples()
    alone, _ = prime_advantages(
        outcome_scores=scores, process_rewards=rewards, response_mask=mask, group=group
    )
    # interleave a second group (ids 3) between the rows of the first
    order = [0, 3, 1, 4, 2]
    scores2 = torch.cat([scores, torch.tensor([0.0, 1.0])])[order]
    rewards2 = torch.cat([rewards, torch.tensor([[0.5, 0.5, 0.5], [0.0, 0.0, 0.0]])])[order]
    mask2 = torch.cat([mask, torch.ones(2, 3)])[order]
    group2 = torch.tensor([7, 7, 7, 3, 3])[order]
    mixed, _ = prime_advantages(
        outcome_scores=scores2, process_rewards=rewards2, response_mask=mask2, group=group2
    )
    torch.testing.assert_close(mixed[[0, 2, 4]], alone)
    # the second group: outcome +-1; mean process 0.5 vs 0: [0.5,0.5,0.5] - 0 -> return [1.5, 1.0, 0.5]
    torch.testing.assert_close(mixed[1], torch.tensor([-1.0 + 1.5, -1.0 + 1.0, -1.0 + 0.5]))
    torch.testing.assert_close(mixed[3], torch.tensor([1.0 - 1.5, 1.0 - 1.0, 1.0 - 0.5]))


def test_group_of_one_gets_zero() -> None:
    adv, ret = prime_advantages(
        outcome_scores=torch.tensor([1.0]),
        process_rewards=torch.tensor([[0.3, -0.7]]),
        response_mask=torch.ones(1, 2),
        group=torch.tensor([0]),
    )
    assert torch.equal(adv, torch.zeros(1, 2)) and torch.equal(ret, torch.zeros(1, 2))


def test_all_equal_outcomes_leave_only_the_process_term() -> None:
    mask = torch.ones(3, 2)
    zero_process, _ = prime_advantages(
        outcome_scores=torch.full((3,), 0.7), process_rewards=torch.zeros(3, 2), response_mask=mask,
        group=torch.zeros(3, dtype=torch.long),
    )  # fmt: skip
    assert torch.equal(zero_process, torch.zeros(3, 2))  # exactly 0 (float64 group statistics)
    rewards = torch.tensor([[0.2, 0.2], [0.0, 0.0], [-0.2, 0.4]])  # means 0.2, 0.0, 0.1
    adv, _ = prime_advantages(
        outcome_scores=torch.full((3,), 1.0), process_rewards=rewards, response_mask=mask,
        group=torch.zeros(3, dtype=torch.long),
    )  # fmt: skip
    # baselines 0.05, 0.15, 0.1 -> baselined [0.15, 0.15], [-0.15, -0.15], [-0.3, 0.3]
    torch.testing.assert_close(adv, torch.tensor([[0.3, 0.15], [-0.3, -0.15], [0.0, 0.3]]))


def test_fully_masked_row_counts_in_the_outcome_baseline_only() -> None:
    rewards = torch.tensor([[0.2, 0.4], [-0.1, 0.1], [X, X]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    adv, _ = prime_advantages(
        outcome_scores=torch.tensor([1.0, 0.0, 1.0]), process_rewards=rewards, response_mask=mask,
        group=torch.zeros(3, dtype=torch.long),
    )  # fmt: skip
    # outcome: 1 - (0+1)/2 = 0.5, 0 - (1+1)/2 = -1; process baselines over rows with tokens only:
    # b0 = 0.0 (row 1), b1 = 0.3 (row 0) -> row 0 [0.2, 0.4] -> [0.6, 0.4]; row 1 [-0.4, -0.2] -> [-0.6, -0.2]
    torch.testing.assert_close(adv, torch.tensor([[1.1, 0.9], [-1.6, -1.2], [0.0, 0.0]]))


def test_no_group_mate_with_tokens_means_no_process_term() -> None:
    adv, _ = prime_advantages(
        outcome_scores=torch.tensor([1.0, 0.0]),
        process_rewards=torch.tensor([[0.5, 0.5], [X, X]]),
        response_mask=torch.tensor([[1.0, 1.0], [0.0, 0.0]]),
        group=torch.tensor([4, 4]),
    )
    torch.testing.assert_close(adv, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))


def test_max_abs_return_normalisation_and_whitening() -> None:
    rewards = torch.tensor([[1.0, -3.0], [2.0, X]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    # returns-to-go: row 0 [-2, -3], row 1 [2]: max |G| = 3
    torch.testing.assert_close(
        normalise_process_rewards(rewards, mask, "max_abs_return"),
        torch.tensor([[1.0, -3.0], [2.0, 0.0]]) / (3.0 + 1e-6),
    )
    scores, rewards, mask, group = _three_samples()
    plain, ret = prime_advantages(
        outcome_scores=scores, process_rewards=rewards, response_mask=mask, group=group
    )
    white, ret_w = prime_advantages(
        outcome_scores=scores, process_rewards=rewards, response_mask=mask, group=group, whiten=True
    )
    torch.testing.assert_close(white, masked_whiten(plain.double(), mask.double()).float())
    torch.testing.assert_close(ret_w, ret)  # returns stay un-whitened
    with pytest.raises(ValueError, match="process_reward_norm must be one of none|max_abs_return"):
        normalise_process_rewards(rewards, mask, "batch")


def test_bad_inputs_fail_naming_them() -> None:
    scores, rewards, mask, group = _three_samples()
    with pytest.raises(ValueError, match=r"outcome_scores must be \[B=3\]"):
        prime_advantages(outcome_scores=scores[:2], process_rewards=rewards, response_mask=mask, group=group)
    with pytest.raises(TypeError, match="group must hold integer prompt ids"):
        prime_advantages(
            outcome_scores=scores, process_rewards=rewards, response_mask=mask, group=group.float()
        )
    with pytest.raises(ValueError, match="gamma must be in"):
        prime_advantages(
            outcome_scores=scores, process_rewards=rewards, response_mask=mask, group=group, gamma=2
        )


def test_the_generic_entry_point_refuses_and_says_where_prime_runs() -> None:
    from verity.algorithms import compute_advantages
    from verity.plugins import load_plugins

    load_plugins()
    with pytest.raises(RuntimeError, match="prime_advantage stage of verity-recipe-prime"):
        compute_advantages(
            "prime",
            token_rewards=torch.zeros(2, 3),
            response_mask=torch.ones(2, 3),
            group=torch.tensor([0, 0]),
        )
