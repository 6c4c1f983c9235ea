"""The model, batch, loss and FLOP count behind ``ci/bench_gpu.py``.

Shapes are Qwen2.5-0.5B's published configuration (and two smaller variants for CPUs);
models are built randomly initialised from them, so nothing is downloaded. The FLOP count
is the module docstring of ``ci/bench_gpu.py``'s "Model FLOPs of one training token".
"""

from __future__ import annotations

from typing import Any

import torch

QWEN25_05B = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
TINY = {
    **QWEN25_05B,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 512,
}
# Qwen2.5's vocabulary over a 2-layer, 256-wide body: the loss head is most of a step (CPU-sized)
VOCAB_SMALL_BODY = {
    **QWEN25_05B,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
# Qwen2.5-0.5B's layers, 4 of them, over a 2,048-token vocabulary: the layers are most of a step (CPU-sized)
LAYERS_SMALL_VOCAB = {**QWEN25_05B, "num_hidden_layers": 4, "vocab_size": 2048}
MODELS = {
    "qwen2.5-0.5b": QWEN25_05B,
    "qwen2.5-vocab-small-body": VOCAB_SMALL_BODY,
    "qwen2.5-layers-small-vocab": LAYERS_SMALL_VOCAB,
    "tiny": TINY,
}
PAD_ID, EOS_ID = 0, 1


def build_model(shape: dict[str, Any], device: torch.device, dtype: torch.dtype = torch.float32) -> Any:
    """A randomly initialised ``Qwen2ForCausalLM`` of ``shape`` on ``device`` (seeded, SDPA attention)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**shape, pad_token_id=PAD_ID, eos_token_id=EOS_ID, bos_token_id=EOS_ID)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with device:
        model = Qwen2ForCausalLM(config)
    return model.to(dtype)


def param_counts(shape: dict[str, Any]) -> dict[str, int]:
    """``body`` (decoder layers and final norm) and ``embedding`` (V x H, tied with the output) parameters."""
    h, f, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    head_dim = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * head_dim
    attention = h * h + h + 2 * (h * kv + kv) + h * h  # q (with bias), k and v (with bias), o
    mlp = 3 * h * f
    body = layers * (attention + mlp + 2 * h) + h
    return {"body": body, "embedding": shape["vocab_size"] * h}


def training_flops_per_row(shape: dict[str, Any], prompt_len: int, response_len: int) -> float:
    """Model FLOPs of forward + backward over one row of ``prompt_len + response_len`` tokens (see module doc)."""
    counts = param_counts(shape)
    seq = prompt_len + response_len
    h, layers = shape["hidden_size"], shape["num_hidden_layers"]
    weights = 6.0 * counts["body"] * seq
    output = 6.0 * counts["embedding"] * (response_len + 1)
    # causal: Q K^T and A V each 2 H S^2 / 2 per layer forward, x3 with the backward
    attention = 6.0 * layers * h * seq * seq
    return weights + output + attention


def train_batch(shape: dict[str, Any], rows: int, prompt_len: int, response_len: int, seed: int) -> dict:
    """Full-length GRPO rows: distinct random prompts and responses, one advantage per row, on CPU."""
    g = torch.Generator().manual_seed(seed)
    vocab = shape["vocab_size"]
    prompts = torch.randint(2, vocab, (rows, prompt_len), generator=g)
    responses = torch.randint(2, vocab, (rows, response_len), generator=g)
    seq = prompt_len + response_len
    advantages = torch.randn(rows, 1, generator=g).expand(rows, response_len).contiguous()
    return {
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": torch.ones(rows, seq, dtype=torch.long),
        "position_ids": torch.arange(seq).expand(rows, seq).contiguous(),
        "responses": responses,
        "response_mask": torch.ones(rows, response_len, dtype=torch.long),
        "advantages": advantages,
    }


def policy_loss(micro: dict, logprobs: torch.Tensor, entropy: torch.Tensor, agg: Any) -> tuple:
    """GRPO's on-policy surrogate ``-sum(A * log p) / tokens`` (ratio 1, so no clipping acts)."""
    adv = micro["advantages"].to(logprobs.device)
    mask = micro["response_mask"].to(logprobs.device)
    return -(logprobs * adv * mask).sum() / agg.global_tokens, {}
