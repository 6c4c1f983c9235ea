"""Per-token log-probs and entropy: hand-computed values and response alignment."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from verity.engines.logprobs import logprobs_and_entropy_from_logits, response_logprobs


def test_two_token_vocabulary_hand_values():
    # logits [0, ln 3] -> p = [1/4, 3/4]
    logits = torch.tensor([[0.0, math.log(3.0)]])
    lp, ent = logprobs_and_entropy_from_logits(logits, torch.tensor([1]))
    assert lp.item() == pytest.approx(math.log(0.75), abs=1e-6)
    expected_entropy = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert ent.item() == pytest.approx(expected_entropy, abs=1e-6)


def test_temperature_divides_logits():
    # logits [0, 2 ln 3] at temperature 2 behave like [0, ln 3]
    logits = torch.tensor([[0.0, 2 * math.log(3.0)]])
    lp, _ = logprobs_and_entropy_from_logits(logits, torch.tensor([0]), temperature=2.0)
    assert lp.item() == pytest.approx(math.log(0.25), abs=1e-6)


def test_chunking_does_not_change_values_and_matches_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11)
    labels = torch.randint(0, 11, (3, 5))
    lp_one, ent_one = logprobs_and_entropy_from_logits(logits, labels, chunk_tokens=1)
    lp_all, ent_all = logprobs_and_entropy_from_logits(logits, labels, chunk_tokens=10_000)
    ref = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    assert torch.allclose(lp_one, ref, atol=1e-6) and torch.allclose(lp_all, ref, atol=1e-6)
    assert torch.allclose(ent_one, ref_ent, atol=1e-5) and torch.allclose(ent_all, ref_ent, atol=1e-5)


def test_gradient_flows_and_entropy_optional():
    logits = torch.zeros(1, 2, requires_grad=True)
    lp, ent = logprobs_and_entropy_from_logits(logits, torch.tensor([0]), compute_entropy=False)
    assert ent is None
    lp.sum().backward()
    # d log softmax_0 / d z = onehot(0) - p = [0.5, -0.5]
    assert torch.allclose(logits.grad, torch.tensor([[0.5, -0.5]]))


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="labels shape"):
        logprobs_and_entropy_from_logits(torch.zeros(2, 3, 4), torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        logprobs_and_entropy_from_logits(torch.zeros(1, 4), torch.zeros(1, dtype=torch.long), temperature=0)


class NextTokenOracle(nn.Module):
    """Logit 20 on token (input_ids[t] + 1) % V at every position t, 0 elsewhere."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        logits = 20.0 * nn.functional.one_hot((input_ids + 1) % self.vocab, self.vocab).float()
        return type("Out", (), {"logits": logits})()


def test_response_positions_are_predicted_by_the_previous_logits():
    vocab = 10
    prompts = torch.tensor([[0, 3, 4]])  # P = 3
    responses = torch.tensor(
        [[5, 6, 9, 0]]
    )  # R = 4: 5 follows 4 (ok), 6 follows 5 (ok), 9 after 6 (wrong), 0 after 9 (ok)
    input_ids = torch.cat([prompts, responses], 1)
    mb = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "position_ids": torch.arange(7).unsqueeze(0),
        "responses": responses,
    }
    lp, _ = response_logprobs(NextTokenOracle(vocab), mb)
    log_z = math.log(math.exp(20.0) + vocab - 1)
    expected = torch.tensor([[20.0 - log_z, 20.0 - log_z, -log_z, 20.0 - log_z]])
    assert torch.allclose(lp, expected, atol=1e-5)


def test_qwen2_logits_to_keep_path_matches_full_logits():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    model = Qwen2ForCausalLM(cfg).eval()
    input_ids = torch.randint(0, 50, (2, 9))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :2] = 0  # left padding of the prompt
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    responses = input_ids[:, 5:]
    mb = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "responses": responses,
    }
    with torch.no_grad():
        lp, ent = response_logprobs(model, mb, temperature=0.7)
        full = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    ref_logits = full[:, 4:8] / 0.7
    ref = torch.log_softmax(ref_logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    assert lp.shape == (2, 4) and ent.shape == (2, 4)
    assert torch.allclose(lp, ref, atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_training_path_without_entropy_gradient_gives_the_autograd_values_and_gradient(temperature):
    """``entropy_grad=False`` takes verity.engines.fused_logprobs: same numbers as the autograd pass."""
    torch.manual_seed(3)
    logits = (torch.randn(5, 7, 33) * 3).requires_grad_()
    labels = torch.randint(0, 33, (5, 7))
    lp_graph, ent_graph = logprobs_and_entropy_from_logits(logits, labels, temperature=temperature)
    (grad_graph,) = torch.autograd.grad(lp_graph.sum(), logits)
    lp, ent = logprobs_and_entropy_from_logits(
        logits, labels, temperature=temperature, entropy_grad=False, chunk_tokens=4
    )
    assert not ent.requires_grad and lp.requires_grad
    assert torch.allclose(ent, ent_graph.detach(), atol=1e-5)
    assert torch.allclose(lp, lp_graph, atol=1e-6)
    (grad,) = torch.autograd.grad(lp.sum(), logits)
    assert torch.allclose(grad, grad_graph, rtol=1e-5, atol=1e-7)
