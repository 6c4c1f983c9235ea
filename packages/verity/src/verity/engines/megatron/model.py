"""A Megatron-core ``GPTModel`` shaped like an HF Qwen2 checkpoint, and one pipeline stage's forward pass.

The model is Megatron-core's own: ``GPTModel`` with the local (no Transformer Engine)
layer spec, RMSNorm, SiLU-gated MLP (``linear_fc1 = [gate; up]``), bias on the fused
QKV projection only, rotary embeddings. Two pieces are verity's:

- **core attention** (:class:`SDPACoreAttention`): the layer spec's ``core_attention``
  slot is filled with ``torch.nn.functional.scaled_dot_product_attention`` under an
  explicit boolean mask (causal AND key-not-padding), instead of Megatron's unfused
  ``DotProductAttention`` (which allocates its score buffer and default causal mask on
  CUDA) or Transformer Engine (not installable without a GPU). Attention dropout is
  not supported (the engine refuses a checkpoint that asks for it).
- **rotary angles per row** (:func:`rotary_angles`): Megatron's ``RotaryEmbedding``
  gives angles for positions ``0..S-1``, the same for every row; HF Qwen2 uses the
  batch's ``position_ids`` (``cumsum(attention_mask) - 1`` for left-padded prompts).
  The stage forward computes ``theta[s, b] = position_ids[b, s] * inv_freq`` and hands
  Megatron's attention a ``[S, B, 1, D]`` tensor, which its unfused rotary code
  broadcasts per row. Rotary scaling variants (YaRN, linear, dynamic) are refused.

Shapes follow Megatron inside the model (``[S, B, H]`` hidden states) and HF at the
edges (``input_ids [B, S]``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Qwen2Shape:
    """The numbers of an HF Qwen2 config that the Megatron model and the conversion need."""

    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    #: bias on the query/key/value projections (Qwen2), none with Qwen3's per-head q/k RMSNorm
    qkv_bias: bool = True
    qk_norm: bool = False
    #: mixture of experts (Qwen3-MoE: every layer's MLP); 0 experts: a dense model
    num_experts: int = 0
    moe_top_k: int = 0
    moe_ffn_hidden_size: int = 0
    #: the top-k routing weights renormalised to sum to 1 (HF ``norm_topk_prob``)
    norm_topk_prob: bool = True

    @property
    def heads_per_group(self) -> int:
        """Query heads that share one key/value head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    @property
    def is_moe(self) -> bool:
        """Whether every layer's MLP is a routed mixture of experts."""
        return self.num_experts > 0


SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3_moe")


def qwen2_shape(hf_config: Any) -> Qwen2Shape:
    """Read and check an HF Qwen2 or Qwen3-MoE config; ``ValueError`` naming what this engine does not support."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type == "qwen2_moe":
        raise ValueError(
            "the megatron engine does not convert model_type 'qwen2_moe' (its sigmoid-gated shared expert "
            "has no tested Megatron mapping yet); use actor.engine=fsdp2 for Qwen2-MoE models"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"the megatron engine converts model_type in {SUPPORTED_MODEL_TYPES}, got {model_type!r}"
        )
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"megatron engine: hidden_act must be 'silu', got {hf_config.hidden_act!r}")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError(
            "megatron engine: sliding-window attention (use_sliding_window=True) is not supported"
        )
    if float(getattr(hf_config, "attention_dropout", 0.0) or 0.0) != 0.0:
        raise ValueError("megatron engine: attention_dropout must be 0 (dropout is not supported)")
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(
            f"megatron engine: only the default rotary embedding is supported, got {rope_type!r}"
        )
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("megatron engine: the config names no rope_theta")
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    hidden = int(hf_config.hidden_size)
    head_dim = int(getattr(hf_config, "head_dim", None) or hidden // heads)
    if heads % kv_heads != 0:
        raise ValueError(f"num_attention_heads={heads} must be a multiple of num_key_value_heads={kv_heads}")
    if model_type == "qwen3_moe":
        from verity.engines.megatron.moe_model import qwen3_moe_fields

        moe = qwen3_moe_fields(hf_config)
    else:
        moe = {}
    return Qwen2Shape(
        vocab_size=int(hf_config.vocab_size),
        hidden_size=hidden,
        ffn_hidden_size=int(hf_config.intermediate_size),
        num_layers=int(hf_config.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf_config.rms_norm_eps),
        rope_theta=float(theta),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        **moe,
    )


def check_divisible(shape: Qwen2Shape, tp: int, pp: int, ep: int = 1) -> None:
    """``ValueError`` when the model cannot be cut into ``tp`` x ``pp`` pieces and its experts over ``ep`` ranks."""
    for what, value, by, name in (
        ("num_attention_heads", shape.num_heads, tp, "tensor_parallel_size"),
        ("num_key_value_heads", shape.num_kv_heads, tp, "tensor_parallel_size"),
        ("intermediate_size", shape.ffn_hidden_size, tp, "tensor_parallel_size"),
        ("num_hidden_layers", shape.num_layers, pp, "pipeline_parallel_size"),
    ):
        if value % by != 0:
            raise ValueError(f"megatron engine: {what}={value} is not divisible by {name}={by}")
    from verity.engines.megatron.moe_model import check_expert_split

    check_expert_split(shape, tp, ep)


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of ``tp`` (Megatron splits it evenly over TP ranks).

    The extra rows are zero in the embedding and the output layer; their logits are
    dropped before any log-probability (:func:`stage_forward`), so they never train.
    """
    return int(math.ceil(vocab_size / tp) * tp)


class SDPACoreAttention(nn.Module):
    """Megatron's ``core_attention`` slot filled by ``scaled_dot_product_attention`` (see the module docstring).

    Called by ``SelfAttention`` with ``query [Sq, B, Nq, D]``, ``key``/``value``
    ``[Sk, B, Ng, D]`` (this TP rank's heads) and ``attention_mask [B, 1, Sq, Sk]``
    (True = masked, Megatron's convention); returns ``[Sq, B, Nq * D]``.
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        **_: Any,
    ) -> None:
        super().__init__()
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError("SDPACoreAttention: attention dropout is not supported")
        self.config = config
        self.softmax_scale = softmax_scale

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if attention_mask is None:
            raise ValueError("SDPACoreAttention needs an explicit attention mask")
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SDPACoreAttention: attention bias and packed sequences are not supported")
        groups = query.shape[2] // key.shape[2]
        q = query.permute(1, 2, 0, 3)  # [B, Nq, Sq, D]
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, scale=self.softmax_scale)
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)


def build_gpt_model(
    shape: Qwen2Shape, tp: int, pp: int, device: torch.device, dtype: torch.dtype, ep: int = 1
) -> nn.Module:
    """This rank's stage of a Megatron ``GPTModel`` shaped like ``shape`` (weights uninitialised).

    A mixture-of-experts shape gets MoE layers holding this rank's ``E / ep`` experts
    (:mod:`.moe_model`). Model-parallel state (``megatron.core.parallel_state``) must be initialised. With
    tied embeddings and ``pp == 1`` the output layer reuses the embedding parameter;
    with ``pp > 1`` the last stage gets its own copy (``output_layer.weight``) that the
    engine keeps equal to the first stage's embedding (same values, summed gradients).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from verity.engines.megatron.moe_model import moe_config_fields, use_moe_layer

    check_divisible(shape, tp, pp, ep)
    config = TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=shape.rms_norm_eps,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=device.type == "cpu",
        perform_initialization=False,  # every weight is loaded from the HF checkpoint
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        **moe_config_fields(shape, ep),
    )
    spec = get_gpt_layer_local_spec(
        num_experts=shape.num_experts or None, qk_layernorm=shape.qk_norm, normalization="RMSNorm"
    )
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    use_moe_layer(spec, shape)
    first = parallel_state.is_pipeline_first_stage()
    last = parallel_state.is_pipeline_last_stage()
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(shape.vocab_size, tp),
        max_sequence_length=1,  # only learned absolute embeddings use it; rotary angles come from position_ids
        pre_process=first,
        post_process=last,
        parallel_output=True,
        share_embeddings_and_output_weights=shape.tie_word_embeddings and pp == 1,
        position_embedding_type="rope",
        rotary_base=int(shape.rope_theta) if float(shape.rope_theta).is_integer() else shape.rope_theta,
    )
    return model.to(device)


def rotary_inv_freq(shape: Qwen2Shape, device: torch.device) -> torch.Tensor:
    """``1 / theta^(2i/D)`` for ``i < D/2`` (float32), as HF Qwen2 and Megatron both define it."""
    exponent = torch.arange(0, shape.head_dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float32)
    return 1.0 / (shape.rope_theta ** (exponent / shape.head_dim))


def rotary_angles(position_ids: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotary angles ``[S, B, 1, D]`` for ``position_ids [B, S]`` (non-interleaved halves, float32)."""
    freqs = position_ids.float()[..., None] * inv_freq[None, None, :]  # [B, S, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.transpose(0, 1).unsqueeze(2).contiguous()


def attention_mask_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Megatron's boolean mask ``[B, 1, S, S]`` (True = masked) from an HF ``attention_mask [B, S]``.

    Query ``i`` may attend key ``j`` when ``j <= i`` and key ``j`` is a real token. A
    padding query with no real key before it attends itself only, so that no softmax
    row is empty (its output reaches no real position and no loss).
    """
    s = attention_mask.shape[1]
    device = attention_mask.device
    causal = torch.ones(s, s, dtype=torch.bool, device=device).tril()
    keys = attention_mask.bool()[:, None, None, :]
    eye = torch.eye(s, dtype=torch.bool, device=device)
    allowed = causal & (keys | eye)
    return ~allowed


def stage_forward(
    model: nn.Module,
    inputs: dict[str, torch.Tensor],
    hidden_in: torch.Tensor | None,
    inv_freq: torch.Tensor,
    *,
    keep_last: int | None = None,
) -> torch.Tensor:
    """Run this rank's pipeline stage on one micro-batch.

    Args:
        model: the stage's ``GPTModel``.
        inputs: ``input_ids``, ``attention_mask``, ``position_ids``, each ``[B, S]``.
        hidden_in: the previous stage's output ``[S, B, H]`` (``None`` on the first stage).
        inv_freq: :func:`rotary_inv_freq` on the model's device.
        keep_last: on the last stage, compute logits for the last ``keep_last`` positions only.

    Returns:
        ``[S, B, H]`` hidden states (not the last stage) or this TP rank's vocabulary
        slice of the logits ``[S', B, V_padded / TP]`` (last stage).
    """
    mask = attention_mask_for(inputs["attention_mask"])
    angles = rotary_angles(inputs["position_ids"], inv_freq)
    if model.pre_process:
        hidden = model.embedding(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"])
    else:
        if hidden_in is None:
            raise ValueError(
                "stage_forward: a stage after the first needs the previous stage's hidden states"
            )
        model.decoder.set_input_tensor(hidden_in)
        hidden = None
    hidden = model.decoder(hidden_states=hidden, attention_mask=mask, rotary_pos_emb=angles)
    if not model.post_process:
        return hidden
    if keep_last is not None:
        hidden = hidden[-keep_last:]
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    logits, _ = model.output_layer(hidden, weight=weight)
    return logits
