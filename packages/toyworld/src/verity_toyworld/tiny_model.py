"""The tiny Qwen2-architecture causal LM of the embedded default.

Built from a :class:`transformers.Qwen2Config` (nothing is downloaded), with
tied input/output embeddings, and saved/loaded with ``save_pretrained``
(safetensors) / ``AutoModelForCausalLM.from_pretrained`` — the same path that
loads a real Qwen2.5 checkpoint.

With the defaults (hidden 128, 2 layers, 4 query heads, 2 key/value heads,
MLP width 512) and the 260-token character vocabulary the model has about
0.53M parameters. Attention defaults to ``sdpa``, the implementation
``from_pretrained`` picks when loading, so a rollout built here and a trainer
that loads the saved folder run the same kernel. At this size ``eager``
decodes no faster on CPU (``ci/reports/2026-12-06-docstring-figures.md``).
"""

from __future__ import annotations

import os

import torch
from transformers import (
    AutoModelForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
)


def build_tiny_qwen2(
    vocab_size: int,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 512,
    max_pos: int = 256,
    *,
    pad_token_id: int | None = None,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    seed: int = 0,
    attn_implementation: str = "sdpa",
) -> Qwen2ForCausalLM:
    """Build a randomly initialised Qwen2 causal LM with tied embeddings, in float32.

    ``vocab_size`` is the number of token ids (embedding rows); ``hidden`` the
    residual width; ``heads`` must divide ``hidden`` and ``kv_heads`` must divide
    ``heads`` (grouped-query attention); ``max_pos`` is the longest sequence
    (prompt + response, in tokens) the model is meant for. ``seed`` makes the
    initial weights reproducible without touching the global RNG.
    """
    for name, value in (
        ("vocab_size", vocab_size),
        ("hidden", hidden),
        ("layers", layers),
        ("heads", heads),
        ("kv_heads", kv_heads),
        ("intermediate", intermediate),
        ("max_pos", max_pos),
    ):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if hidden % heads:
        raise ValueError(f"heads: expected a divisor of hidden={hidden}, got {heads}")
    if heads % kv_heads:
        raise ValueError(f"kv_heads: expected a divisor of heads={heads}, got {kv_heads}")
    if (hidden // heads) % 2:
        raise ValueError(f"hidden/heads: rotary embeddings need an even head size, got {hidden // heads}")
    if attn_implementation not in ("eager", "sdpa"):
        raise ValueError(f"attn_implementation: expected 'eager' or 'sdpa', got {attn_implementation!r}")
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        max_position_embeddings=max_pos,
        tie_word_embeddings=True,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        attn_implementation=attn_implementation,
    )
    # fork_rng(devices=[]) saves/restores only the CPU generator, which is
    # what initialisation on CPU draws from.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.to(torch.float32)
    return model


def build_tiny_qwen2_for(tokenizer: PreTrainedTokenizerBase, **kwargs: object) -> Qwen2ForCausalLM:
    """``build_tiny_qwen2`` sized for ``tokenizer`` (vocabulary and pad/bos/eos ids taken from it)."""
    return build_tiny_qwen2(
        len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **kwargs,  # type: ignore[arg-type]
    )


def load_causal_lm(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
) -> PreTrainedModel:
    """Load a causal LM saved with ``save_pretrained`` (the tiny model or a real checkpoint), in eval mode.

    ``attn_implementation=None`` keeps what the checkpoint's config says.
    Raises FileNotFoundError when ``path`` holds no ``config.json``.
    """
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"path: expected a model directory with config.json, got {str(path)!r}")
    kwargs: dict[str, object] = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    model.eval()
    return model
