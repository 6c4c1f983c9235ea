"""The implicit PRM's rewards, loss and separation metrics against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch
from verity.algorithms import AggregationContext
from verity_recipe_prime.implicit_prm import (
    auc,
    classification_accuracy,
    cross_entropy_sum,
    make_prm_loss,
    process_rewards,
    sequence_scores,
)


def test_process_rewards_and_scores_by_hand() -> None:
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, -7.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-0.6, -3.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    r = process_rewards(logprobs, ref, mask, beta=0.1)
    torch.testing.assert_close(r, torch.tensor([[0.05, -0.1, 0.0], [0.05, 0.0, 0.0]]))
    torch.testing.assert_close(sequence_scores(logprobs, ref, mask, beta=0.1), torch.tensor([-0.05, 0.05]))


def _bce(q: float, c: float) -> float:
    return -(c * math.log(1 / (1 + math.exp(-q))) + (1 - c) * math.log(1 - 1 / (1 + math.exp(-q))))


def test_loss_is_the_mini_batch_mean_cross_entropy_over_rows_with_tokens() -> None:
    # q = beta * sum(logprobs - ref): rows give 0.5 * 2 = 1.0, 0.5 * -4 = -2.0, and a row with no token
    micro = {
        "prm_ref_logprobs": torch.zeros(3, 2),
        "acc": torch.tensor([1.0, 1.0, 0.0]),
        "response_mask": torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]]),
    }
    logprobs = torch.tensor([[1.0, 1.0], [-3.0, -1.0], [5.0, 5.0]])
    agg = AggregationContext(global_tokens=4.0, global_seqs=5.0, max_response_len=2)
    loss, metrics = make_prm_loss(0.5)(micro, logprobs, torch.zeros(3, 2), agg)
    # S = 5 sequences over the whole mini-batch (other micro-batches and ranks hold the rest)
    assert float(loss) == pytest.approx((_bce(1.0, 1.0) + _bce(-2.0, 1.0)) / 5.0, rel=1e-6)
    assert metrics["prm/score_mean"] == pytest.approx((1.0 - 2.0 + 0.0) / 3)


def test_loss_gradient_is_sigmoid_minus_label_times_beta() -> None:
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, -0.25]], requires_grad=True)
    ref = torch.tensor([[-1.2, -2.1], [-0.1, -0.2]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    labels = torch.tensor([1.0, 0.3])  # soft labels are allowed
    beta = 0.7
    cross_entropy_sum(sequence_scores(logprobs, ref, mask, beta), labels, mask).backward()
    q = beta * ((logprobs.detach() - ref) * mask).sum(-1)
    want = ((torch.sigmoid(q) - labels) * beta).unsqueeze(-1) * mask
    torch.testing.assert_close(logprobs.grad, want)


def test_auc_counts_ties_half_and_needs_both_classes() -> None:
    labels = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0])
    assert auc(torch.tensor([3.0, 2.0, 1.0, 0.0, 5.0]), labels) == 1.0
    assert auc(torch.tensor([0.0, 0.0, 1.0, 2.0, 0.0]), labels) == 0.0
    assert auc(torch.zeros(5), labels) == 0.5  # the PRM at its start: every score 0
    # positives {1, 2, 5} vs negatives {2, 0}: pairs won 1/2 + 1 + (0.5 + 1) + 1 + 1 = ... by hand
    scores = torch.tensor([1.0, 2.0, 2.0, 0.0, 5.0])
    # 1 vs (2, 0): 0 + 1; 2 vs (2, 0): 0.5 + 1; 5 vs (2, 0): 1 + 1 -> 4.5 / 6
    assert auc(scores, labels) == pytest.approx(4.5 / 6)
    assert auc(scores, torch.ones(5)) is None and auc(scores, torch.zeros(5)) is None


def test_classification_accuracy_at_zero_with_ties_half() -> None:
    labels = torch.tensor([1.0, 0.0, 1.0, 0.0])
    assert classification_accuracy(torch.tensor([0.3, -0.2, -1.0, 0.5]), labels) == 0.5
    assert classification_accuracy(torch.zeros(4), labels) == 0.5
    assert classification_accuracy(torch.tensor([0.1, -0.1, 2.0, -3.0]), labels) == 1.0


def test_beta_must_be_positive() -> None:
    with pytest.raises(ValueError, match="beta must be > 0"):
        make_prm_loss(0.0)
