"""The Megatron MoE layer's top-k choice as a module the shared router code can read and replay.

:class:`~verity.engines.megatron.moe_dispatch.HostTopKRouter` computes its router logits
``[N, E]`` (N = ``S x b`` positions, sequence-major as Megatron lays hidden states out) and hands
them to a :class:`ReplayableTopKRouter` child, which answers ``(logits, weights [N, k], experts
[N, k])`` exactly as HF's Qwen3-MoE router does (softmax over all experts in float32, top-k,
renormalised when ``norm_topk_prob``). Because it has HF's router interface,
:class:`verity.rollout.moe_routes.RouterTap` hooks it unchanged, so the Megatron engine keeps each
layer's logits and experts, and replays given experts with weights recomputed from the current
logits, through the same :class:`verity.engines.moe_router.RouterTerms` as the FSDP2 engine: same
router losses, same metrics, same replay rule. Megatron's own aux loss, z-loss and
``RouterReplay`` stay off (``moe_model.moe_config_fields``): its aux loss is normalised
differently, and its replay knows no ``-1`` (route normally) positions.

:func:`stage_router_terms` builds those terms for a stage and :func:`prepare_forward` points them
at a micro-batch's ``[b, S]`` rows before its forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from verity.engines.moe_router import RouterSettings, RouterTerms, router_terms_for
from verity.rollout.moe_routes import ROUTES_KEY

__all__ = ["ReplayableTopKRouter", "prepare_forward", "routing_map", "stage_router_terms"]


class ReplayableTopKRouter(nn.Module):
    """The top-k choice of one MoE layer, from its router logits (module docstring); no parameters."""

    def __init__(self, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    def forward(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logits [N, E], weights [N, k] in the logits' dtype, experts [N, k] int64)``."""
        probs = torch.softmax(logits, dtype=torch.float32, dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), experts


def routing_map(
    logits: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's router answer from a top-k choice: ``probs [N, E]`` (the weights at the chosen experts,
    0 elsewhere) and ``routing_map [N, E]`` bool (True at the chosen experts)."""
    probs = torch.zeros_like(logits, dtype=weights.dtype).scatter(1, experts, weights)
    chosen = torch.zeros_like(logits, dtype=torch.bool).scatter(1, experts, True)
    return probs, chosen


def stage_router_terms(
    model: nn.Module, settings: RouterSettings | None, pipeline_stages: int
) -> RouterTerms | None:
    """:class:`RouterTerms` of a Megatron stage's MoE layers; None for a dense model or under pipeline parallelism.

    With several pipeline stages each holds part of the layers and the loss lives on the last one,
    so router terms are not computed (no router metrics); ``ValueError`` when ``settings`` ask for a
    router loss or replay there, or on a dense model.
    """
    if pipeline_stages > 1:
        if settings is not None and settings != RouterSettings():
            raise ValueError(
                f"megatron engine: router settings {settings} need pipeline_parallel_size=1 "
                f"(got {pipeline_stages}): the router terms of a model split over stages are not computed"
            )
        return None
    return router_terms_for(model, settings)


def prepare_forward(terms: RouterTerms | None, inputs: dict[str, Any]) -> None:
    """Before one micro-batch's forward: its routes (``routed_experts`` ``[b, S, L, k]``, replayed when the
    settings say so) and its real positions (``attention_mask`` ``[b, S]``), both put in Megatron's
    sequence-major position order (``N = S x b``)."""
    if terms is None:
        return
    mask = inputs["attention_mask"].transpose(0, 1).reshape(-1).bool()
    routes = inputs.get(ROUTES_KEY)
    if routes is not None:
        routes = routes.transpose(0, 1).reshape(-1, *routes.shape[2:])
    terms.prepare(routes, mask)
