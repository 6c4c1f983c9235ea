"""build_tiny_qwen2: architecture, seeded init, safetensors save/load with equal logits."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2ForCausalLM
from verity_toyworld.char_tokenizer import CharTokenizer
from verity_toyworld.tiny_model import build_tiny_qwen2, build_tiny_qwen2_for, load_causal_lm


def test_architecture_and_parameter_count():
    model = build_tiny_qwen2(100)
    assert isinstance(model, Qwen2ForCausalLM)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    # embeddings 100*128; per layer: q 128*128+128, k,v 128*64+64 each, o 128*128,
    # MLP 3*128*512, two RMSNorms 2*128; final norm 128.
    per_layer = (128 * 128 + 128) + 2 * (128 * 64 + 64) + 128 * 128 + 3 * 128 * 512 + 2 * 128
    assert sum(p.numel() for p in model.parameters()) == 100 * 128 + 2 * per_layer + 128
    assert model.dtype == torch.float32


def test_seeded_init_is_reproducible_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a = build_tiny_qwen2(50, seed=7)
    assert torch.equal(torch.rand(1), expected_next)
    b = build_tiny_qwen2(50, seed=7)
    c = build_tiny_qwen2(50, seed=8)
    assert all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_save_load_gives_equal_logits(tmp_path):
    tokenizer = CharTokenizer()
    model = build_tiny_qwen2_for(tokenizer).eval()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = load_causal_lm(tmp_path)  # sdpa, like the builder's default
    assert loaded.config.pad_token_id == 0 and loaded.config.eos_token_id == 2
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = torch.randint(4, 100, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
        auto = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
        assert torch.equal(auto(ids).logits, model(ids).logits)
        eager = load_causal_lm(tmp_path, attn_implementation="eager")  # same math, other kernel
        assert eager.config._attn_implementation == "eager"
        torch.testing.assert_close(eager(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-5)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="heads"):
        build_tiny_qwen2(100, hidden=128, heads=3)
    with pytest.raises(ValueError, match="kv_heads"):
        build_tiny_qwen2(100, heads=4, kv_heads=3)
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_qwen2(0)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_causal_lm("/nonexistent/model")
