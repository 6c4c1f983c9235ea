"""Value loss with clipping; entropy from logits and the entropy bonus."""

from __future__ import annotations

import math

import pytest
import torch
from verity.algorithms import (
    AggregationContext,
    ValueLossConfig,
    entropy_bonus,
    entropy_from_logits,
    value_loss,
)


def tensor(rows):
    return torch.tensor(rows, dtype=torch.float32)


def run_value_loss(values, old, returns, mask, config):
    v = values.clone().requires_grad_(True)
    loss, metrics = value_loss(
        values=v,
        old_values=old,
        returns=returns,
        response_mask=mask,
        agg=AggregationContext.from_mask(mask),
        config=config,
    )
    loss.backward()
    return loss.detach(), metrics, v.grad


def test_value_loss_clipping_hand_computed():
    # clip 0.2
    # t0: V 1.0, old 0.5, G 0.0: unclipped 1.0; clipped V 0.7 -> 0.49; max 1.0 (unclipped)
    # t1: V 2.0, old 2.0, G 3.0: both 1.0
    # t2: V 0.0, old 0.5, G 0.1: unclipped 0.01; clipped V 0.3 -> 0.04; max 0.04 (clipped, no grad)
    values, old, returns = tensor([[1.0, 2.0, 0.0]]), tensor([[0.5, 2.0, 0.5]]), tensor([[0.0, 3.0, 0.1]])
    loss, metrics, grad = run_value_loss(
        values, old, returns, torch.ones(1, 3), ValueLossConfig(cliprange_value=0.2)
    )
    assert loss.item() == pytest.approx(0.5 * (1.0 + 1.0 + 0.04) / 3)
    # gradient of 0.5 (V - G)^2 / 3 is (V - G) / 3 on unclipped tokens
    torch.testing.assert_close(grad, tensor([[1 / 3, -1 / 3, 0.0]]))
    assert metrics["vf_clipfrac"] == pytest.approx(1 / 3)
    assert metrics["vpred_mean"] == pytest.approx(1.0)


def test_value_loss_without_clipping_and_with_mask():
    values, old, returns = tensor([[1.0, 2.0, 0.0]]), tensor([[0.5, 2.0, 0.5]]), tensor([[0.0, 3.0, 0.1]])
    mask = tensor([[1, 1, 0]])
    loss, metrics, grad = run_value_loss(values, old, returns, mask, ValueLossConfig(cliprange_value=None))
    assert loss.item() == pytest.approx(0.5 * (1.0 + 1.0) / 2)
    torch.testing.assert_close(grad, tensor([[0.5, -0.5, 0.0]]))
    assert metrics["vf_clipfrac"] == 0.0


def test_value_loss_explained_variance():
    returns = tensor([[1.0, 2.0, 3.0]])
    _, metrics, _ = run_value_loss(returns.clone(), returns, returns, torch.ones(1, 3), ValueLossConfig())
    assert metrics["vf_explained_var"] == pytest.approx(1.0)
    _, metrics, _ = run_value_loss(
        torch.zeros(1, 3), torch.zeros(1, 3), returns, torch.ones(1, 3), ValueLossConfig()
    )
    assert metrics["vf_explained_var"] == pytest.approx(0.0)


def test_entropy_hand_computed():
    logits = tensor(
        [[[0.0, 0.0, 0.0, 0.0], [0.0, float("-inf"), 0.0, float("-inf")], [1000.0, 0.0, 0.0, 0.0]]]
    )
    h = entropy_from_logits(logits)
    assert h.shape == (1, 3)
    torch.testing.assert_close(h, tensor([[math.log(4), math.log(2), 0.0]]))


def test_entropy_matches_definition_chunked_and_in_low_precision():
    torch.manual_seed(0)
    logits = 3 * torch.randn(2, 5, 11)
    probs = torch.softmax(logits, -1)
    expected = -(probs * torch.log(probs)).sum(-1)
    torch.testing.assert_close(entropy_from_logits(logits), expected)
    torch.testing.assert_close(entropy_from_logits(logits, chunk_size=3), expected)
    h16 = entropy_from_logits(logits.bfloat16())
    assert h16.dtype == torch.float32
    torch.testing.assert_close(h16, expected, atol=0.05, rtol=0.02)


def test_entropy_gradient_is_finite_with_banned_tokens():
    logits = tensor([[0.5, float("-inf"), -0.5]]).requires_grad_(True)
    entropy_from_logits(logits, chunk_size=1).sum().backward()
    assert torch.all(torch.isfinite(logits.grad))
    assert logits.grad[0, 1] == 0.0


def test_entropy_bonus_is_negative_scaled_aggregate():
    entropy = tensor([[1.0, 2.0], [3.0, 0.0]])
    mask = tensor([[1, 1], [1, 0]])
    loss, metrics = entropy_bonus(
        entropy=entropy, response_mask=mask, agg=AggregationContext.from_mask(mask), coef=0.01
    )
    assert loss.item() == pytest.approx(-0.01 * 6 / 3)
    assert metrics["entropy"] == pytest.approx(2.0)
