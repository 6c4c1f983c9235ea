"""Tiny mixture-of-experts causal LMs: Qwen3-MoE (the ``moe`` preset) and Qwen2-MoE (tests).

Built from :class:`transformers.Qwen3MoeConfig` / :class:`transformers.Qwen2MoeConfig` (nothing is
downloaded), with tied embeddings, saved and loaded like any HF checkpoint. Every decoder layer is
sparse: a router (``mlp.gate``, a linear map to ``experts`` logits) picks ``top_k`` experts per token
and the layer adds their outputs weighted by the renormalised router probabilities; the Qwen2-MoE
layer adds a shared expert behind a sigmoid gate as well.

With the defaults (hidden 64, 2 layers, 8 experts of width 128, top-2) and the 260-token character
vocabulary the Qwen3-MoE model has about 0.44M parameters of which about 0.14M are active per token.
"""

from __future__ import annotations

import torch
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

__all__ = ["MOE_FAMILIES", "build_tiny_moe", "build_tiny_moe_for"]

#: the MoE architectures this module builds, by HF ``model_type``
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe")


def build_tiny_moe(
    vocab_size: int,
    family: str = "qwen3_moe",
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    experts: int = 8,
    top_k: int = 2,
    expert_intermediate: int = 128,
    shared_intermediate: int = 128,
    max_pos: int = 256,
    *,
    pad_token_id: int | None = None,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    seed: int = 0,
) -> PreTrainedModel:
    """A randomly initialised tiny MoE causal LM in float32 (``family``: one of :data:`MOE_FAMILIES`).

    ``experts`` routed experts of width ``expert_intermediate`` per layer, ``top_k`` of them per
    token; ``shared_intermediate`` is the Qwen2-MoE shared expert's width (unused by Qwen3-MoE).
    ``heads`` must divide ``hidden`` and ``kv_heads`` must divide ``heads``. ``seed`` makes the
    weights reproducible without touching the global RNG.
    """
    for name, value in (
        ("vocab_size", vocab_size),
        ("hidden", hidden),
        ("layers", layers),
        ("experts", experts),
    ):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if family not in MOE_FAMILIES:
        raise ValueError(f"family: expected one of {list(MOE_FAMILIES)}, got {family!r}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k: expected 1..experts={experts}, got {top_k}")
    if hidden % heads or heads % kv_heads:
        raise ValueError(
            f"heads/kv_heads: expected divisors of hidden={hidden} and heads, got {heads}/{kv_heads}"
        )
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=expert_intermediate,
        moe_intermediate_size=expert_intermediate,
        num_experts=experts,
        num_experts_per_tok=top_k,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        max_position_embeddings=max_pos,
        tie_word_embeddings=True,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        attn_implementation="sdpa",
    )
    if family == "qwen3_moe":
        config, cls = Qwen3MoeConfig(head_dim=hidden // heads, **common), Qwen3MoeForCausalLM
    else:
        config = Qwen2MoeConfig(shared_expert_intermediate_size=shared_intermediate, **common)
        cls = Qwen2MoeForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    model.to(torch.float32)
    return model


def build_tiny_moe_for(tokenizer: PreTrainedTokenizerBase, **kwargs: object) -> PreTrainedModel:
    """:func:`build_tiny_moe` sized for ``tokenizer`` (vocabulary and pad/bos/eos ids taken from it)."""
    return build_tiny_moe(
        len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **kwargs,  # type: ignore[arg-type]
    )
