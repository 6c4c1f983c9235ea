"""MFU of a mixture-of-experts model counts only the experts a token visits."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig
from verity.hardware.flops import active_parameters, moe_layer_count, training_flops_per_token
from verity_toyworld.tiny_moe import build_tiny_moe


def test_tiny_moe_active_parameters_leave_out_the_unvisited_experts():
    model = build_tiny_moe(260, "qwen3_moe")  # 8 experts, top-2, 2 layers, hidden 64, expert width 128
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    active = active_parameters(total, model.config)
    assert moe_layer_count(model.config) == 2
    assert active == total - experts * 6 // 8  # 6 of the 8 experts idle in each layer
    assert training_flops_per_token(active) < training_flops_per_token(total)


def test_qwen2_moe_shared_expert_stays_active():
    model = build_tiny_moe(260, "qwen2_moe")
    total = sum(p.numel() for p in model.parameters())
    shared = sum(p.numel() for n, p in model.named_parameters() if "shared_expert" in n)
    active = active_parameters(total, model.config)
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    assert active == total - routed * 6 // 8 and shared > 0


def test_qwen3_30b_a3b_published_shape_is_about_3_3b_active_of_30_5b():
    config = Qwen3MoeConfig(  # Qwen/Qwen3-30B-A3B's config.json
        vocab_size=151936,
        hidden_size=2048,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    active = active_parameters(total, config)
    assert 30.4e9 < total < 30.6e9, total
    assert 3.2e9 < active < 3.4e9, active


def test_a_dense_config_counts_every_parameter():
    from transformers import Qwen2Config

    assert active_parameters(1000, Qwen2Config()) == 1000
