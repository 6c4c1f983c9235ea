"""The mixture-of-experts side of the Megatron model: Qwen3-MoE's routing, read from its HF config.

A Qwen3-MoE layer is attention with per-head RMSNorm on queries and keys (no QKV bias),
then a routed MLP: the router ``gate`` (``[E, H]``, no bias) scores every expert,

    p = softmax(h @ gate.T)                 over all E experts, in float32
    top-k experts by p; weights w = p_topk (/ sum p_topk when norm_topk_prob)
    out = sum_k w_k * down_k(silu(gate_k(h)) * up_k(h))

The router's top-k step runs exactly these lines
(:class:`~verity.engines.megatron.moe_routing.ReplayableTopKRouter`, which the shared router
code taps for the router losses and metrics and replays routes into); the config still says
what it means in Megatron's terms: ``moe_router_pre_softmax=False`` for
``norm_topk_prob=True`` (softmax of the top-k logits is the renormalised top-k of the full
softmax), ``True`` otherwise. Megatron's own load-balancing loss, z-loss and router replay
stay off: ``actor.moe``'s terms are computed from the router logits by
:mod:`verity.engines.moe_router`, as on the FSDP2 engine. No input jitter, no capacity limit
(no token is dropped), no shared expert.

Experts are Megatron's ``SequentialMLP`` (one ``linear_fc1 = [gate; up]`` and
``linear_fc2`` per local expert, run one after another): grouped GEMM needs
Transformer Engine or the ``grouped_gemm`` CUDA package, neither of which runs on a
host CPU. Tokens reach their experts' ranks through :mod:`.moe_dispatch`.
"""

from __future__ import annotations

from typing import Any

#: how tokens travel to their experts; the only dispatcher this engine runs
TOKEN_DISPATCHER = "alltoall"


def qwen3_moe_fields(hf_config: Any) -> dict[str, Any]:
    """The MoE fields of :class:`~verity.engines.megatron.model.Qwen2Shape` from an HF Qwen3-MoE config.

    ``ValueError`` naming the setting for what Megatron's layers here would not compute
    as HF does: dense layers between MoE ones, attention bias.
    """
    experts = int(hf_config.num_experts)
    top_k = int(hf_config.num_experts_per_tok)
    sparse_step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    dense_layers = list(getattr(hf_config, "mlp_only_layers", None) or [])
    if sparse_step != 1 or dense_layers:
        raise ValueError(
            "megatron engine: a Qwen3-MoE with dense layers between its MoE ones (decoder_sparse_step="
            f"{sparse_step}, mlp_only_layers={dense_layers}) is not supported; every layer must be MoE"
        )
    if getattr(hf_config, "attention_bias", False):
        raise ValueError("megatron engine: a Qwen3-MoE with attention_bias=True is not supported")
    if not 1 <= top_k <= experts:
        raise ValueError(
            f"megatron engine: num_experts_per_tok={top_k} must be in [1, num_experts={experts}]"
        )
    return {
        "qkv_bias": False,
        "qk_norm": True,
        "num_experts": experts,
        "moe_top_k": top_k,
        "moe_ffn_hidden_size": int(hf_config.moe_intermediate_size),
        "norm_topk_prob": bool(getattr(hf_config, "norm_topk_prob", True)),
    }


def check_expert_split(shape: Any, tp: int, ep: int) -> None:
    """``ValueError`` when ``ep`` ranks cannot split the experts, or a layout this engine does not run."""
    if not shape.is_moe:
        if ep > 1:
            raise ValueError(
                f"megatron engine: expert_parallel_size={ep} needs a mixture-of-experts model, and this "
                "model is dense; set expert_parallel_size=1"
            )
        return
    if shape.num_experts % ep:
        raise ValueError(
            f"megatron engine: expert_parallel_size={ep} does not divide the model's num_experts={shape.num_experts}"
        )
    if tp > 1:
        raise ValueError(
            f"megatron engine: a mixture-of-experts model with tensor_parallel_size={tp} needs Megatron's "
            "sequence parallelism, which this engine does not run yet; use tensor_parallel_size=1 and "
            "expert_parallel_size to split the experts"
        )


def moe_config_fields(shape: Any, ep: int) -> dict[str, Any]:
    """``TransformerConfig`` keyword arguments for the MoE layers (empty for a dense model)."""
    if not shape.is_moe:
        return {}
    return {
        "num_moe_experts": shape.num_experts,
        "moe_router_topk": shape.moe_top_k,
        "moe_ffn_hidden_size": shape.moe_ffn_hidden_size,
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not shape.norm_topk_prob,
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_z_loss_coeff": None,
        "moe_input_jitter_eps": None,
        "moe_token_dispatcher_type": TOKEN_DISPATCHER,
        "moe_grouped_gemm": False,
        "moe_permute_fusion": False,
        "moe_router_fusion": False,
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": 1,
    }


def use_moe_layer(spec: Any, shape: Any) -> None:
    """Put :class:`~verity.engines.megatron.moe_dispatch.HostMoELayer` (and its router) in the layer spec's
    MLP slot (MoE only)."""
    if not shape.is_moe:
        return
    import logging

    from verity.engines.megatron.moe_dispatch import HostMoELayer, HostTopKRouter

    spec.submodules.mlp.module = HostMoELayer
    spec.submodules.mlp.submodules.router = HostTopKRouter
    # Megatron's layer logs "Unknown MLP type" for any MoE layer class but its own, then builds it with
    # the default process groups, which are the ones HostMoELayer uses: the line says nothing here
    layer_log = logging.getLogger("megatron.core.transformer.transformer_layer")
    if not any(isinstance(f, _UnknownMlpFilter) for f in layer_log.filters):
        layer_log.addFilter(_UnknownMlpFilter())


class _UnknownMlpFilter:
    """Drops Megatron's "Unknown MLP type" warning (see :func:`use_moe_layer`)."""

    def filter(self, record: object) -> bool:
        return not str(getattr(record, "msg", "")).startswith("Unknown MLP type")
