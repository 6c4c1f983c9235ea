"""FSDP2Engine on CUDA: bf16 mixed precision (needs a GPU; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch
from verity.engines import FSDP2Engine, OptimConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VOCAB, P, R = 100, 5, 6


def tiny_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return Qwen2ForCausalLM(cfg)


def make_batch(rows: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    responses = torch.randint(1, VOCAB, (rows, R), generator=g)
    input_ids = torch.cat([torch.randint(1, VOCAB, (rows, P), generator=g), responses], 1)
    attention_mask = torch.ones_like(input_ids)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": responses,
        "response_mask": torch.ones(rows, R),
    }


def push_up_loss(mb, logprobs, entropy, agg):
    return -(logprobs * mb["response_mask"]).sum() / agg.global_tokens, {}


def test_bf16_logprobs_close_to_fp32_and_training_is_finite():
    batch = make_batch()
    fp32 = FSDP2Engine(tiny_qwen2(), None, device="cuda", mixed_precision=False)
    bf16 = FSDP2Engine(tiny_qwen2(), OptimConfig(lr=1e-3), device="cuda")
    assert bf16.mixed_precision
    lp32, _ = fp32.compute_logprobs(batch, 2)
    lp16, ent16 = bf16.compute_logprobs(batch, 2)
    assert lp16.dtype == torch.float32 and lp16.device.type == "cpu"
    assert torch.allclose(lp16, lp32, atol=5e-2)
    metrics = bf16.train_step(batch, push_up_loss, 2)
    assert torch.isfinite(torch.tensor([metrics["loss"], metrics["grad_norm"]])).all()
    assert next(bf16.model.parameters()).dtype == torch.float32  # master weights stay fp32
