"""FSDP2Engine on CUDA: bf16 mixed precision (needs a GPU; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import make_unpadded_batch, push_up_loss, tiny_qwen2
from verity.engines import FSDP2Engine, OptimConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_bf16_logprobs_close_to_fp32_and_training_is_finite():
    batch = make_unpadded_batch(4, seed=1)
    fp32 = FSDP2Engine(tiny_qwen2(tie_word_embeddings=False), None, device="cuda", mixed_precision=False)
    bf16 = FSDP2Engine(tiny_qwen2(tie_word_embeddings=False), OptimConfig(lr=1e-3), device="cuda")
    assert bf16.mixed_precision
    lp32, _ = fp32.compute_logprobs(batch, 2)
    lp16, ent16 = bf16.compute_logprobs(batch, 2)
    assert lp16.dtype == torch.float32 and lp16.device.type == "cpu"
    assert torch.allclose(lp16, lp32, atol=5e-2)
    metrics = bf16.train_step(batch, push_up_loss, 2)
    assert torch.isfinite(torch.tensor([metrics["loss"], metrics["grad_norm"]])).all()
    assert next(bf16.model.parameters()).dtype == torch.float32  # master weights stay fp32
