"""The memory estimator's formulas: a model's shape, and the bytes of each thing a worker holds.

    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(path))   # parameters counted on the meta device
    activation_bytes_per_token(shape, act_bytes=2, checkpointing=False)  # one decoder layer, saved for backward

Every function returns bytes (``int``); token counts are positions of one forward pass. The
formulas (``docs/hardware.md``, "Memory plan") are stated here once and used by
:mod:`verity.launch.memory_plan`, which adds them up per worker for a run config.

Activations per token and decoder layer, saved for backward, after the accounting of
Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
section 4.1: attention ``11sbh + 5as^2b``, MLP ``19sbh``, layer norms ``4sbh`` bytes in 16 bits),
redone for a pre-norm SwiGLU block with grouped-query attention, no dropout and a fused
(flash / memory-efficient) attention kernel, with ``p`` the activation bytes, ``h`` the hidden
size, ``g d`` the key/value width (KV heads x head dim) and ``I`` the MLP width::

    two RMSNorms            2 (4 + p) h      each keeps a float32 copy of its input and its normalised output
    q, k (after RoPE), v    p (h + 2 g d)    kept by the attention kernel
    attention output        2 p h            the kernel's output and the o_proj input (a contiguous copy)
    SwiGLU                  4 p I            gate, up, silu(gate), silu(gate) * up
    eager attention         + 2 p a s        scores and softmax of ``a`` heads over ``s`` positions

With gradient checkpointing only each layer's input (``p h`` per token and layer) is kept,
plus one layer's activations while that layer is recomputed in backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = [
    "GIB",
    "ModelShape",
    "activation_bytes",
    "activation_bytes_per_token",
    "kv_cache_bytes",
    "logprob_head_bytes",
    "prefill_bytes",
]

GIB = 2**30


@dataclass(frozen=True)
class ModelShape:
    """What the estimator reads of a model: its parameter counts and the decoder's widths.

    ``n_params``: every parameter (tied embeddings counted once); ``layer_params``: one decoder
    layer's; ``root_params``: the rest (embeddings, final norm, output layer, a vision tower),
    which FSDP2 gathers as one unit. Widths in elements.
    """

    n_params: int
    layer_params: int
    root_params: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool

    @property
    def kv_width(self) -> int:
        """Key (or value) elements per token and layer: KV heads x head dim."""
        return self.kv_heads * self.head_dim

    @property
    def lm_head_params(self) -> int:
        """Parameters of the output layer that a value head replaces (0 when tied to the embeddings)."""
        return 0 if self.tied else self.vocab * self.hidden

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelShape:
        """Count the parameters of the model ``config`` describes on the meta device (no weights, no download).

        A vision-language config (Qwen2-VL family) is built with its vision tower, which counts in
        ``root_params``; the widths are the text model's.
        """
        import torch
        from transformers import AutoModelForCausalLM

        from verity.engines.hf_loading import decoder_layers, quiet_loading

        auto_class: Any = AutoModelForCausalLM
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if text is not config:
            from transformers import AutoModelForImageTextToText

            auto_class = AutoModelForImageTextToText
        with quiet_loading(), torch.device("meta"):
            model = auto_class.from_config(config)
        n_params = sum(p.numel() for p in model.parameters())
        layers = decoder_layers(model)
        text_layers = [m for m in layers if sum(1 for _ in m.parameters()) and _is_text_layer(m, text)]
        layer_params = max((sum(p.numel() for p in m.parameters()) for m in text_layers), default=0)
        in_layers = sum(sum(p.numel() for p in m.parameters()) for m in layers)
        heads = int(text.num_attention_heads)
        hidden = int(text.hidden_size)
        return cls(
            n_params=n_params,
            layer_params=layer_params,
            root_params=n_params - in_layers,
            hidden=hidden,
            layers=int(text.num_hidden_layers),
            heads=heads,
            kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(text, "head_dim", None) or hidden // heads),
            intermediate=int(text.intermediate_size),
            vocab=int(text.vocab_size),
            tied=bool(getattr(config, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False))),
        )


def _is_text_layer(module: Any, text: Any) -> bool:
    """Whether a decoder block is the language model's (a vision tower's blocks have another width)."""
    attn = getattr(module, "self_attn", None)
    q = getattr(attn, "q_proj", None)
    return q is None or int(q.in_features) == int(text.hidden_size)


def activation_bytes_per_token(shape: ModelShape, act_bytes: int, *, eager_positions: int = 0) -> int:
    """Bytes one decoder layer keeps for backward per token (the module docstring's formula).

    ``act_bytes``: 2 under bf16 compute, 4 in float32. ``eager_positions``: the row length ``s``
    when the attention is ``eager`` (it keeps ``a x s`` scores and probabilities per token), else 0.
    """
    p, h = act_bytes, shape.hidden
    norms = 2 * (4 + p) * h
    qkv = p * (h + 2 * shape.kv_width)
    attention_out = 2 * p * h
    swiglu = 4 * p * shape.intermediate
    eager = 2 * p * shape.heads * eager_positions
    return norms + qkv + attention_out + swiglu + eager


def activation_bytes(
    shape: ModelShape, tokens: int, act_bytes: int, *, checkpointing: bool, eager_positions: int = 0
) -> int:
    """Activations of one micro-batch of ``tokens`` positions kept for backward, in bytes.

    Without checkpointing: every layer's (``L x per_token``) plus the final norm's; with it:
    each layer's input (``L x p h``) plus one layer recomputed in backward.
    """
    per_layer = activation_bytes_per_token(shape, act_bytes, eager_positions=eager_positions)
    final_norm = (4 + act_bytes) * shape.hidden
    if checkpointing:
        return tokens * (shape.layers * act_bytes * shape.hidden + per_layer + final_norm)
    return tokens * (shape.layers * per_layer + final_norm)


def logprob_head_bytes(
    shape: ModelShape, scored_tokens: int, logits_bytes: int, chunk_tokens: int, *, entropy_grad: bool = False
) -> int:
    """The training pass's loss head over the vocabulary ``V`` for ``N = scored_tokens`` positions.

    :mod:`verity.engines.fused_logprobs`: the logits ``[N, V]`` kept for backward and their
    gradient, both in ``logits_bytes``, plus two float32 ``[min(chunk_tokens, N), V]`` working
    chunks (log-softmax and its exp). With an entropy bonus (``entropy_grad``) one autograd pass
    over float32 ``[N, V]`` instead: the logits and their gradient plus three float32 copies
    (the cast, log-softmax, softmax).
    """
    n, v = scored_tokens, shape.vocab
    if entropy_grad:
        return n * v * (2 * logits_bytes + 3 * 4)
    return 2 * n * v * logits_bytes + 2 * min(chunk_tokens, n) * v * 4


def kv_cache_bytes(shape: ModelShape, rows: int, positions: int, kv_bytes: int) -> int:
    """A KV cache of ``rows`` sequences of ``positions`` tokens: ``2 L g d x bytes x rows x positions``."""
    return 2 * shape.layers * shape.kv_width * kv_bytes * rows * positions


def prefill_bytes(shape: ModelShape, rows: int, prompt_tokens: int, act_bytes: int) -> int:
    """A no-grad forward's working set over ``rows x prompt_tokens`` positions: the residual stream and
    one layer's widest intermediates (q, k, v, attention output ``~4h``, gate, up and their product ``3I``)."""
    return rows * prompt_tokens * act_bytes * (5 * shape.hidden + 3 * shape.intermediate)


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ints."""
    return -(-a // b) if b > 0 else a


def gib(n: float) -> float:
    """Bytes to GiB, rounded to 0.1."""
    return math.floor(n / GIB * 10 + 0.5) / 10
