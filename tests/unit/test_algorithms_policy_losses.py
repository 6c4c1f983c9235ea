"""Policy losses: hand-computed values, gradients and metrics."""

from __future__ import annotations

import math

import pytest
import torch
from verity.algorithms import AggregationContext, PolicyLossConfig, get_policy_loss


def tensor(rows):
    return torch.tensor(rows, dtype=torch.float32)


def call(name, logprobs, old_logprobs, advantages, mask, config=None, generator=None):
    logprobs = logprobs.clone().requires_grad_(True)
    ctx = AggregationContext.from_mask(mask)
    loss, metrics = get_policy_loss(name)(
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
        response_mask=mask,
        agg=ctx,
        config=config or PolicyLossConfig(name=name),
        generator=generator,
    )
    loss.backward()
    return loss.detach(), metrics, logprobs.grad


# PPO case: ratios r = 1.5, 0.5, 1.1, 4.0 with advantages 1, 1, -1, -1 (one row, 4 tokens).
OLD = tensor([[-1.0, -2.0, -0.5, -3.0]])
RATIOS = [1.5, 0.5, 1.1, 4.0]
NEW = OLD + torch.log(tensor([RATIOS]))
ADV = tensor([[1.0, 1.0, -1.0, -1.0]])
ONES = torch.ones(1, 4)


def test_ppo_clip_symmetric():
    # per token max(-A r, -A clip(r, 0.8, 1.2)):
    #   t0: max(-1.5, -1.2) = -1.2 (clipped)   t1: max(-0.5, -0.8) = -0.5
    #   t2: max(1.1, 1.1) = 1.1                t3: max(4.0, 1.2) = 4.0
    loss, metrics, grad = call("ppo", NEW, OLD, ADV, ONES)
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.1 + 4.0) / 4, abs=1e-6)
    # d/dlogp of -A r is -A r on unclipped tokens; token-mean divides by 4
    torch.testing.assert_close(grad, tensor([[0.0, -0.5 / 4, 1.1 / 4, 4.0 / 4]]))
    assert metrics["pg_clipfrac"] == pytest.approx(0.25)
    assert metrics["pg_clipfrac_lower"] == 0.0
    assert metrics["ppo_kl"] == pytest.approx(-sum(math.log(r) for r in RATIOS) / 4, abs=1e-6)


def test_ppo_dual_clip_bounds_negative_advantages():
    config = PolicyLossConfig(clip_ratio_c=3.0)
    # t3: min(4.0, -A * c = 3.0) = 3.0, constant -> no gradient
    loss, metrics, grad = call("ppo", NEW, OLD, ADV, ONES, config)
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.1 + 3.0) / 4, abs=1e-6)
    torch.testing.assert_close(grad, tensor([[0.0, -0.5 / 4, 1.1 / 4, 0.0]]))
    assert metrics["pg_clipfrac_lower"] == pytest.approx(0.25)


def test_ppo_clip_higher():
    config = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.6)
    # t0 ratio 1.5 < 1.6 is no longer clipped: -1.5, gradient -A r / 4 = -1.5/4
    loss, metrics, grad = call("ppo", NEW, OLD, ADV, ONES, config)
    assert loss.item() == pytest.approx((-1.5 - 0.5 + 1.1 + 4.0) / 4, abs=1e-6)
    torch.testing.assert_close(grad, tensor([[-1.5 / 4, -0.5 / 4, 1.1 / 4, 4.0 / 4]]))
    assert metrics["pg_clipfrac"] == 0.0
    # the low side still clips: A < 0 with r = 0.5 -> clip(0.5) = 0.8
    _, metrics, grad = call("ppo", OLD + math.log(0.5), OLD, -ONES, ONES, config)
    assert metrics["pg_clipfrac"] == 1.0
    torch.testing.assert_close(grad, torch.zeros(1, 4))


def test_ppo_masked_tokens_do_not_count():
    mask = tensor([[1, 1, 0, 0]])
    loss, metrics, grad = call("ppo", NEW, OLD, ADV, mask)
    assert loss.item() == pytest.approx((-1.2 - 0.5) / 2, abs=1e-6)
    torch.testing.assert_close(grad, tensor([[0.0, -0.25, 0.0, 0.0]]))
    assert metrics["pg_clipfrac"] == pytest.approx(0.5)


def test_gspo_sequence_ratio_clipping():
    # row 0 (2 tokens): log-ratios 0.1, 0.3 -> s = exp(0.2) = 1.2214 > 1.0004, A = 1 -> clipped, no grad
    # row 1 (3 tokens): log-ratios 0 -> s = 1, A = -2 -> loss 2 per token, grad -A s = 2 per token
    old = tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    new = old + tensor([[0.1, 0.3, 7.0], [0.0, 0.0, 0.0]])  # 7.0 sits on a masked position
    adv = tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    mask = tensor([[1, 1, 0], [1, 1, 1]])
    config = PolicyLossConfig(loss_agg_mode="seq-mean-token-mean")
    loss, metrics, grad = call("gspo", new, old, adv, mask, config)
    # seq-mean-token-mean: (mean(-1.0004, -1.0004) + mean(2, 2, 2)) / 2
    assert loss.item() == pytest.approx((-1.0004 + 2.0) / 2, abs=1e-6)
    torch.testing.assert_close(grad, tensor([[0.0, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3]]))
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 5)
    assert metrics["gspo_seq_ratio_mean"] == pytest.approx((math.exp(0.2) + 1) / 2, abs=1e-6)


def test_gspo_token_form_has_the_sequence_gradient():
    # Unclipped: gradient equals that of the sequence-level objective -A_i * s_i (seq-mean).
    torch.manual_seed(0)
    old = -torch.rand(3, 5)
    new = old + 0.05 * torch.randn(3, 5)
    adv = torch.tensor([1.0, -0.5, 2.0]).unsqueeze(-1).expand(3, 5).contiguous()
    mask = tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    config = PolicyLossConfig(
        loss_agg_mode="seq-mean-token-mean", gspo_clip_ratio_low=0.9, gspo_clip_ratio_high=9.0
    )
    loss, _, grad = call("gspo", new, old, adv, mask, config)
    ref = new.clone().requires_grad_(True)
    seq_ratio = torch.exp(((ref - old) * mask).sum(-1) / mask.sum(-1))
    ref_loss = (-adv[:, 0] * seq_ratio).mean()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach())
    torch.testing.assert_close(grad, ref.grad)


def test_gpg_loss():
    # -A logp: 2*1 + 1*2 = 4 over 2 tokens -> 2; grad -A / 2
    loss, metrics, grad = call(
        "gpg", tensor([[-1.0, -2.0]]), tensor([[-1.0, -2.0]]), tensor([[2.0, 1.0]]), torch.ones(1, 2)
    )
    assert loss.item() == pytest.approx(2.0)
    torch.testing.assert_close(grad, tensor([[-1.0, -0.5]]))
    assert metrics["ppo_kl"] == 0.0


def test_cispo_clips_the_weight_not_the_gradient():
    # ratios 1.5, 0.5, 1.1; A = 1, -1, 2; logp = -0.5, -1, -2
    # upper bound 1.28, no lower bound -> weights 1.28, 0.5, 1.1
    # per token -w A logp: 0.64, -0.5, 4.4
    logp = tensor([[-0.5, -1.0, -2.0]])
    old = logp - torch.log(tensor([[1.5, 0.5, 1.1]]))
    adv = tensor([[1.0, -1.0, 2.0]])
    loss, metrics, grad = call("cispo", logp, old, adv, torch.ones(1, 3))
    assert loss.item() == pytest.approx((0.64 - 0.5 + 4.4) / 3, abs=1e-6)
    torch.testing.assert_close(grad, tensor([[-1.28 / 3, 0.5 / 3, -2.2 / 3]]))
    assert metrics["cispo_clipfrac"] == pytest.approx(1 / 3)
    # a lower bound 0.8 clips the weight of token 1 too: -(0.8)(-1)(-1) = -0.8
    config = PolicyLossConfig(cispo_clip_ratio_low=0.2)
    loss, metrics, grad = call("cispo", logp, old, adv, torch.ones(1, 3), config)
    assert loss.item() == pytest.approx((0.64 - 0.8 + 4.4) / 3, abs=1e-6)
    torch.testing.assert_close(grad, tensor([[-1.28 / 3, 0.8 / 3, -2.2 / 3]]))
    assert metrics["cispo_clipfrac"] == pytest.approx(2 / 3)


# Covariance case: A = 2, -2, 0.5, 0.5; logp = -1, -3, -2, -2.
# mean A = 0.25, mean logp = -2 -> Cov = (1.75)(1), (-2.25)(-1), 0, 0 = 1.75, 2.25, 0, 0.
COV_ADV = tensor([[2.0, -2.0, 0.5, 0.5]])
COV_LOGP = tensor([[-1.0, -3.0, -2.0, -2.0]])


def test_clip_cov_detaches_the_selected_token():
    # ratios 1, 0.5, 1, 1: token 1 (A < 0, r = 0.5) is clipped by PPO so it is not a candidate;
    # token 0 (Cov 1.75 in (1, 5)) is the only candidate; k = max(1, int(2e-4 * 4)) = 1.
    old = COV_LOGP - torch.log(tensor([[1.0, 0.5, 1.0, 1.0]]))
    loss, metrics, grad = call(
        "clip_cov", COV_LOGP, old, COV_ADV, torch.ones(1, 4), generator=torch.Generator().manual_seed(0)
    )
    # values kept: -2, 2 * 0.8 = 1.6, -0.5, -0.5
    assert loss.item() == pytest.approx((-2.0 + 1.6 - 0.5 - 0.5) / 4, abs=1e-6)
    torch.testing.assert_close(grad, tensor([[0.0, 0.0, -0.125, -0.125]]))
    assert metrics["clip_cov_frac"] == pytest.approx(0.25)
    assert metrics["pg_clipfrac"] == pytest.approx(0.25)
    # with ratio 0 nothing is selected and token 0 keeps its gradient -A r / 4 = -0.5
    config = PolicyLossConfig(clip_cov_ratio=0.0)
    _, metrics, grad = call("clip_cov", COV_LOGP, old, COV_ADV, torch.ones(1, 4), config)
    torch.testing.assert_close(grad, tensor([[-0.5, 0.0, -0.125, -0.125]]))
    assert metrics["clip_cov_frac"] == 0.0


def test_kl_cov_penalises_the_top_covariance_token():
    # ratios 1.2, 0.5, 1, 1; top-1 Cov is token 1 (2.25).
    # token 1: -A r + |log r| = 1.0 + ln 2; its gradient -A r + sign(log r) = 1.0 - 1.0 = 0
    old = COV_LOGP - torch.log(tensor([[1.2, 0.5, 1.0, 1.0]]))
    loss, metrics, grad = call("kl_cov", COV_LOGP, old, COV_ADV, torch.ones(1, 4))
    assert loss.item() == pytest.approx((-2.4 + 1.0 + math.log(2) - 0.5 - 0.5) / 4, abs=1e-6)
    torch.testing.assert_close(grad, tensor([[-0.6, 0.0, -0.125, -0.125]]))
    assert metrics["kl_cov_frac"] == pytest.approx(0.25)
    assert metrics["ppo_kl_abs"] == pytest.approx((math.log(1.2) + math.log(2)) / 4, abs=1e-6)


def test_cov_losses_with_no_valid_tokens_are_zero():
    mask = torch.zeros(1, 4)
    for name in ("clip_cov", "kl_cov"):
        loss, metrics, grad = call(name, COV_LOGP, COV_LOGP, COV_ADV, mask)
        assert loss.item() == 0.0
        torch.testing.assert_close(grad, torch.zeros(1, 4))


@pytest.mark.parametrize("name", ["ppo", "gspo", "gpg", "cispo", "clip_cov", "kl_cov"])
def test_fully_masked_row_has_no_gradient_and_no_nan(name):
    torch.manual_seed(1)
    old = -torch.rand(3, 4)
    new = old + 0.1 * torch.randn(3, 4)
    new[1] = float("nan")  # garbage on a fully masked row must not leak
    adv = torch.randn(3, 4)
    mask = tensor([[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0]])
    loss, metrics, grad = call(name, new, old, adv, mask, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(loss)
    assert torch.all(grad[1] == 0)
    assert all(math.isfinite(v) for v in metrics.values())


def test_at_old_policy_every_ratio_loss_has_the_policy_gradient():
    # At logprobs == old_logprobs, PPO/GSPO/CISPO/clip-cov(no selection) all give grad -A / T.
    torch.manual_seed(2)
    logp = -torch.rand(2, 3)
    adv = torch.randn(2, 1).expand(2, 3).contiguous()
    mask = torch.ones(2, 3)
    expected = -adv / 6
    for name in ("ppo", "gspo", "cispo", "gpg"):
        _, _, grad = call(name, logp, logp, adv, mask)
        torch.testing.assert_close(grad, expected, msg=name)
