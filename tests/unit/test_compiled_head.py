"""verity.engines.compiled_head: the loss head through inductor agrees with the eager heads."""

from __future__ import annotations

import pytest
import torch
from helpers.logprob_reference import assert_head_matches_float64
from helpers.tiny_models import make_padded_batch, tiny_qwen2
from verity.engines import FSDP2Engine, OptimConfig
from verity.engines.compiled_layers import compile_unavailable_reason
from verity.engines.fused_logprobs import chosen_token_logprobs

_UNAVAILABLE = compile_unavailable_reason(torch.device("cpu"))
pytestmark = pytest.mark.skipif(
    _UNAVAILABLE is not None, reason=f"inductor cannot compile here: {_UNAVAILABLE}"
)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_values_and_gradient_match_log_softmax(temperature):
    torch.manual_seed(0)
    logits = (torch.randn(11, 300) * 4).requires_grad_()
    labels = torch.randint(0, 300, (11,))
    weights = torch.randn(11)

    def head(x, y, tau):
        return chosen_token_logprobs(x, y, temperature=tau, compiled=True)

    grad = assert_head_matches_float64(head, logits, labels, weights, temperature)
    # a wrong label changes the gradient: the one-hot term is really there
    (shifted,) = torch.autograd.grad(
        (
            chosen_token_logprobs(logits, (labels + 1) % 300, temperature=temperature, compiled=True)[0]
            * weights
        ).sum(),
        logits,
    )
    assert not torch.allclose(shifted, grad, atol=1e-3)


def test_bf16_logits_get_a_bf16_gradient_equal_to_the_eager_heads():
    torch.manual_seed(1)
    base = (torch.randn(40, 500) * 3).to(torch.bfloat16)
    labels = torch.randint(0, 500, (40,))
    out = {}
    for compiled in (False, True):
        x = base.clone().requires_grad_()
        lp, ent = chosen_token_logprobs(x, labels, chunk_tokens=7, compiled=compiled)
        lp.sum().backward()
        out[compiled] = (lp.detach(), ent, x.grad)
    assert out[True][2].dtype == torch.bfloat16
    torch.testing.assert_close(out[True][0], out[False][0], rtol=0, atol=1e-5)
    torch.testing.assert_close(out[True][1], out[False][1], rtol=0, atol=1e-4)
    torch.testing.assert_close(
        out[True][2].float(), out[False][2].float(), rtol=0, atol=8e-3
    )  # 1 bf16 ulp at 1


def test_a_rows_value_does_not_depend_on_how_many_rows_ran_with_it():
    """What makes a recomputed old log-prob equal the training pass's own: row by row, bit for bit."""
    torch.manual_seed(2)
    logits = torch.randn(64, 257).to(torch.bfloat16)
    labels = torch.randint(0, 257, (64,))
    with torch.no_grad():
        whole, ent_whole = chosen_token_logprobs(logits, labels, compiled=True)
        part, ent_part = chosen_token_logprobs(logits[5:23], labels[5:23], compiled=True)
    assert torch.equal(whole[5:23], part) and torch.equal(ent_whole[5:23], ent_part)
    assert chosen_token_logprobs(logits, labels, compiled=True, compute_entropy=False)[1] is None


def _loss(mb, logprobs, entropy, agg):
    return -(logprobs * mb["advantages"] * mb["response_mask"]).sum() / agg.global_tokens, {}


def test_an_engine_with_a_compiled_head_trains_like_the_eager_head_and_its_passes_agree():
    batch = make_padded_batch(rows=6, seed=4)
    grads, logprobs = {}, {}
    for compiled in (False, True):
        engine = FSDP2Engine(tiny_qwen2(seed=3), OptimConfig(lr=1e-2), device="cpu", compile_head=compiled)
        assert (engine.compiled_head, engine.compiled_layers) == (compiled, 0)
        seen = []

        def loss_fn(mb, lp, ent, agg, seen=seen):
            seen.append(lp.detach().clone())
            return _loss(mb, lp, ent, agg)

        engine.forward_backward(batch, loss_fn, 3)
        grads[compiled] = engine.full_gradients()
        no_grad, _ = engine.compute_logprobs(batch, 3)
        assert torch.equal(torch.cat(seen), no_grad)  # the old log-prob equals the update's own, to the bit
        logprobs[compiled] = no_grad
    torch.testing.assert_close(logprobs[True], logprobs[False], rtol=0, atol=1e-5)
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_compiled_head_without_inductor_says_what_is_missing(monkeypatch):
    import verity.engines.fsdp2 as fsdp2

    monkeypatch.setattr(fsdp2, "compile_unavailable_reason", lambda device: "no C++ compiler was found")
    with pytest.raises(RuntimeError, match="compile_head=True: no C\\+\\+ compiler"):
        FSDP2Engine(tiny_qwen2(), OptimConfig(lr=1e-2), device="cpu", compile_head=True)


def test_the_kernel_choice_is_checked():
    from verity.engines import compiled_head

    with pytest.raises(ValueError, match="must be one of \\['auto', 'inductor', 'triton'\\], got 'cuda'"):
        compiled_head.use_kernels("cuda")
    compiled_head.use_kernels("triton")
    try:
        with pytest.raises(ValueError, match="the Triton loss head runs 16/32-bit logits on CUDA"):
            chosen_token_logprobs(torch.randn(3, 5), torch.zeros(3, dtype=torch.long), compiled=True)
    finally:
        compiled_head.use_kernels("auto")
