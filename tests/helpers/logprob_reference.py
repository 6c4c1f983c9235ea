"""The loss head computed in float64 by autograd: what the hand-written heads are checked against."""

from __future__ import annotations

import torch


def float64_head(logits: torch.Tensor, labels: torch.Tensor, temperature: float):
    """``(log p(labels) [N], entropy [N])`` of ``logits [N, V] / temperature``, float64, through autograd."""
    z = logits.double() / temperature
    logp = z.log_softmax(-1)
    return logp.gather(-1, labels[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def assert_head_matches_float64(head, logits, labels, weights, temperature) -> torch.Tensor:
    """``head(logits, labels, temperature) -> (logprobs, entropy)``: values and the weighted gradient
    against :func:`float64_head`; returns the head's gradient."""
    lp, ent = head(logits, labels, temperature)
    ref_lp, ref_ent = float64_head(logits, labels, temperature)
    assert lp.dtype == torch.float32 and not ent.requires_grad
    assert torch.allclose(lp.double(), ref_lp, atol=1e-5)
    assert torch.allclose(ent.double(), ref_ent.detach(), atol=1e-5)
    (grad,) = torch.autograd.grad((lp * weights).sum(), logits)
    (ref_grad,) = torch.autograd.grad((ref_lp * weights.double()).sum(), logits)
    assert torch.allclose(grad, ref_grad, atol=1e-6)
    return grad
