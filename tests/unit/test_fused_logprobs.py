"""verity.engines.fused_logprobs: values, gradient (float64 gradcheck), dtypes, chunking, inputs left alone."""

from __future__ import annotations

import pytest
import torch
from helpers.logprob_reference import assert_head_matches_float64
from verity.engines.fused_logprobs import chosen_token_logprobs


@pytest.mark.parametrize("chunk", [1, 3, 7, 4096])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_values_and_gradient_match_log_softmax(chunk, temperature):
    torch.manual_seed(chunk)
    logits = (torch.randn(7, 50) * 4).requires_grad_()
    labels = torch.randint(0, 50, (7,))
    weights = torch.randn(7)

    def head(x, y, tau):
        return chosen_token_logprobs(x, y, temperature=tau, chunk_tokens=chunk)

    assert_head_matches_float64(head, logits, labels, weights, temperature)


def test_float64_gradcheck():
    logits = torch.randn(5, 9, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 9, (5,))
    assert torch.autograd.gradcheck(
        lambda x: chosen_token_logprobs(x, labels, temperature=0.8, chunk_tokens=2)[0], (logits,)
    )


def test_bf16_logits_get_a_bf16_gradient_close_to_the_float32_one():
    torch.manual_seed(1)
    base = torch.randn(16, 300) * 3
    labels = torch.randint(0, 300, (16,))
    x16 = base.to(torch.bfloat16).requires_grad_()
    x32 = base.to(torch.bfloat16).float().requires_grad_()
    lp16, _ = chosen_token_logprobs(x16, labels, chunk_tokens=5)
    lp32, _ = chosen_token_logprobs(x32, labels, chunk_tokens=5)
    assert lp16.dtype == torch.float32 and torch.allclose(lp16, lp32)  # float32 math on the same values
    lp16.sum().backward()
    lp32.sum().backward()
    assert x16.grad.dtype == torch.bfloat16
    assert torch.allclose(x16.grad.float(), x32.grad, atol=1e-2)


def test_the_logits_are_not_changed_in_place():
    logits = torch.randn(4, 10, requires_grad=True)
    before = logits.detach().clone()
    lp, _ = chosen_token_logprobs(logits, torch.randint(0, 10, (4,)), temperature=0.5, chunk_tokens=2)
    lp.sum().backward()
    assert torch.equal(logits.detach(), before)


def test_no_entropy_and_no_rows():
    lp, ent = chosen_token_logprobs(
        torch.randn(3, 5), torch.zeros(3, dtype=torch.long), compute_entropy=False
    )
    assert ent is None and lp.shape == (3,)
    empty = torch.zeros(0, 5, requires_grad=True)
    lp, ent = chosen_token_logprobs(empty, torch.zeros(0, dtype=torch.long))
    assert lp.shape == ent.shape == (0,)
    lp.sum().backward()
    assert empty.grad.shape == (0, 5)


def test_shapes_are_checked():
    with pytest.raises(ValueError, match=r"logits must be \[N, V\] and labels \[N\]"):
        chosen_token_logprobs(torch.randn(2, 3, 4), torch.zeros(2, 3, dtype=torch.long))
