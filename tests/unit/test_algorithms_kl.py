"""KL estimators, straight-through gradients, KL in the reward, controllers."""

from __future__ import annotations

import math

import pytest
import torch
from verity.algorithms import (
    AdaptiveKLController,
    AggregationContext,
    FixedKLController,
    KLConfig,
    apply_kl_penalty,
    build_kl_controller,
    kl_loss,
    kl_penalty,
)


def tensor(rows):
    return torch.tensor(rows, dtype=torch.float32)


# d = logp - ref = 0.5, -1.0;  log rho = -d = -0.5, 1.0;  rho = e^-0.5 = 0.60653066, e = 2.71828183
LOGP = tensor([[-1.0, -2.0]])
REF = tensor([[-1.5, -1.0]])
RHO = [math.exp(-0.5), math.e]


def value_and_grad(kind, logp=LOGP, ref=REF, clamp=10.0):
    x = logp.clone().requires_grad_(True)
    kl = kl_penalty(x, ref, kind, clamp=clamp)
    kl.sum().backward()
    return kl.detach(), x.grad


@pytest.mark.parametrize(
    ("kind", "value", "grad"),
    [
        ("k1", [0.5, -1.0], [1.0, 1.0]),
        ("k2", [0.125, 0.5], [0.5, -1.0]),  # grad of d^2/2 is d
        ("abs", [0.5, 1.0], [1.0, -1.0]),
        # rho - 1 - log rho: 0.60653066 - 1 + 0.5, e - 1 - 1; grad 1 - rho
        ("k3", [RHO[0] - 0.5, math.e - 2.0], [1 - RHO[0], 1 - RHO[1]]),
        # straight-through: the base kind's value, the gradient of k2 (= d)
        ("k1+", [0.5, -1.0], [0.5, -1.0]),
        ("k3+", [RHO[0] - 0.5, math.e - 2.0], [0.5, -1.0]),
        ("abs+", [0.5, 1.0], [0.5, -1.0]),
    ],
)
def test_estimators_hand_computed(kind, value, grad):
    v, g = value_and_grad(kind)
    torch.testing.assert_close(v, tensor([value]))
    torch.testing.assert_close(g, tensor([grad]))


def test_aliases():
    for alias, kind in (
        ("kl", "k1"),
        ("mse", "k2"),
        ("low_var_kl", "k3"),
        ("low_var_kl+", "k3+"),
        ("kl+", "k1+"),
    ):
        torch.testing.assert_close(value_and_grad(alias), value_and_grad(kind))


def test_k3_clamp_and_overflow_guard():
    # d = -5: k3 = e^5 - 1 - 5 = 142.41 -> clamped to 10, no gradient; k3+ keeps the k2 gradient d = -5
    v, g = value_and_grad("k3", tensor([[-6.0]]), tensor([[-1.0]]))
    assert v.item() == 10.0 and g.item() == 0.0
    v, g = value_and_grad("k3+", tensor([[-6.0]]), tensor([[-1.0]]))
    assert v.item() == 10.0 and g.item() == pytest.approx(-5.0)
    v, _ = value_and_grad("k3", tensor([[-6.0]]), tensor([[-1.0]]), clamp=None)
    assert v.item() == pytest.approx(math.exp(5) - 6, rel=1e-6)
    # exponent clamped at 20 even without a value clamp: d = -30 -> e^20 - 21
    v, _ = value_and_grad("k3", tensor([[-31.0]]), tensor([[-1.0]]), clamp=None)
    assert math.isfinite(v.item()) and v.item() == pytest.approx(math.exp(20) - 21, rel=1e-5)


def test_exact_expectations_match_kl_and_its_gradient():
    """Weight each vocabulary item by its (detached) probability: the exact expectation over
    on-policy samples. k1, k3 values are unbiased for KL(pi||ref); the gradient of k2 and of the
    straight-through kinds is the gradient of KL(pi||ref); k3's own gradient is that of KL(ref||pi)."""
    torch.manual_seed(0)
    theta = torch.randn(7, requires_grad=True)
    ref = torch.log_softmax(torch.randn(7), dim=-1)

    def expectation(kind):
        logp = torch.log_softmax(theta, dim=-1)
        per_item = kl_penalty(logp.unsqueeze(0), ref.unsqueeze(0), kind, clamp=None)[0]
        return (logp.exp().detach() * per_item).sum()

    logp = torch.log_softmax(theta, dim=-1)
    forward_kl = (logp.exp() * (logp - ref)).sum()
    reverse_kl = (ref.exp() * (ref - logp)).sum()
    (grad_forward,) = torch.autograd.grad(forward_kl, theta, retain_graph=True)
    (grad_reverse,) = torch.autograd.grad(reverse_kl, theta)
    for kind in ("k1", "k3", "k1+", "k3+"):
        torch.testing.assert_close(expectation(kind), forward_kl.detach(), msg=kind)
    for kind in ("k2", "k1+", "k3+", "abs+"):
        (g,) = torch.autograd.grad(expectation(kind), theta)
        torch.testing.assert_close(g, grad_forward, msg=kind)
    (g,) = torch.autograd.grad(expectation("k3"), theta)
    torch.testing.assert_close(g, grad_reverse)
    (g,) = torch.autograd.grad(expectation("k1"), theta)
    torch.testing.assert_close(g, torch.zeros(7), atol=1e-6, rtol=0)


def test_ref_logprobs_get_no_gradient():
    ref = REF.clone().requires_grad_(True)
    out = kl_penalty(LOGP.clone().requires_grad_(True), ref, "k3")
    out.sum().backward()
    assert ref.grad is None


def test_kl_loss_aggregates():
    mask = tensor([[1, 0]])
    loss, metrics = kl_loss(
        logprobs=LOGP, ref_logprobs=REF, response_mask=mask, agg=AggregationContext.from_mask(mask), kind="k2"
    )
    assert loss.item() == pytest.approx(0.125)
    assert metrics["kl_loss"] == pytest.approx(0.125)


def test_apply_kl_penalty_hand_computed():
    rewards = tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0], [5.0, 0.0, 0.0]])
    logp = tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    ref = logp - tensor([[0.1, 0.2, 0.3], [0.5, -0.5, 9.0], [1.0, 1.0, 1.0]])  # k1 = logp - ref
    mask = tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    out, metrics = apply_kl_penalty(rewards, logp, ref, mask, kl_coef=0.1, kind="k1")
    torch.testing.assert_close(out, tensor([[-0.01, -0.02, 0.97], [-0.05, 2.05, 0.0], [5.0, 0.0, 0.0]]))
    # per-sequence mean KL: 0.2 and 0.0 (the fully masked row is not a sequence)
    assert metrics["kl"] == pytest.approx(0.1)
    assert metrics["kl_coef"] == pytest.approx(0.1)


def test_fixed_controller_never_changes():
    ctrl = FixedKLController(0.05)
    ctrl.update(current_kl=10.0, n_steps=100)
    assert ctrl.value == 0.05


def test_adaptive_controller_proportional_update():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=100)
    ctrl.update(current_kl=1.5, n_steps=10)  # error clipped to +0.2 -> x (1 + 0.2 * 10/100)
    assert ctrl.value == pytest.approx(0.102)
    ctrl.update(current_kl=0.9, n_steps=10)  # error -0.1 -> x (1 - 0.01)
    assert ctrl.value == pytest.approx(0.102 * 0.99)
    ctrl.update(current_kl=0.0, n_steps=100)  # error clipped to -0.2 -> x 0.8
    assert ctrl.value == pytest.approx(0.102 * 0.99 * 0.8)


def test_build_controller_from_config():
    assert isinstance(build_kl_controller(KLConfig(kl_ctrl="fixed", kl_coef=0.2)), FixedKLController)
    ctrl = build_kl_controller(KLConfig(kl_ctrl="adaptive", kl_coef=0.2, kl_target=0.5, kl_horizon=50))
    assert isinstance(ctrl, AdaptiveKLController) and ctrl.value == 0.2 and ctrl.target == 0.5
    with pytest.raises(ValueError, match="kl_ctrl"):
        build_kl_controller(KLConfig(kl_ctrl="pid"))
