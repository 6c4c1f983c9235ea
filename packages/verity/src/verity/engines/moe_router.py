"""A training engine's handling of a mixture-of-experts model's routers: losses, metrics, routing replay.

:class:`RouterTerms` wraps an engine's log-prob function (``fn(model, micro, *, layout, **head)``,
:mod:`verity.engines.packed`) for a model with top-k routers (:func:`verity.rollout.moe_routes.moe_routers`):

* every forward keeps each MoE layer's router logits and chosen experts (a
  :class:`~verity.rollout.moe_routes.RouterTap`); the training pass turns them into the router losses
  (:mod:`verity.algorithms.router_losses`) added to the loss with ``aux_loss_coef`` and ``z_loss_coef``,
  and into the step's router metrics (:data:`ROUTER_METRICS`), over the real tokens of the forward;
* with ``routing_replay``, a micro-batch carrying ``routed_experts`` ``[b, P+R, L, k]`` (the rollout's
  experts for every column of ``input_ids``) runs with those experts in every MoE layer. Its routes are
  aligned with the columns, so a replayed pass runs the padded layout without shared prompts (the
  padding-free window of :func:`verity.engines.logprobs.padding_free_window`, whose columns it slices
  the routes with), whatever ``packed`` says.

A micro-batch's router term is weighted by its share of the mini-batch's response tokens, so that the
sum over micro-batches and ranks (the engine's gradient contract) is the token-weighted mean.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from verity.algorithms.router_losses import expert_load, load_balancing_loss, router_entropy, router_z_loss
from verity.engines.logprobs import padding_free_window, response_logprobs
from verity.rollout.moe_routes import RouterTap, moe_routers

__all__ = ["ROUTER_METRICS", "RouterSettings", "RouterTerms", "router_terms_for"]

#: the per-step router metrics (MLflow names; docs/algorithms.md, "Mixture of experts")
ROUTER_METRICS = (
    "moe/aux_loss",  # load-balancing loss, mean over MoE layers (before its coefficient)
    "moe/z_loss",  # router z-loss, mean over MoE layers (before its coefficient)
    "moe/router_entropy",  # router distribution's entropy, mean over tokens and layers, nats
    "moe/expert_load_max_over_mean",  # most-loaded expert's tokens / mean tokens per expert, mean over layers
    "moe/expert_load_max_over_mean_max",  # the same, the worst layer
    # with routing replay: share of (token, layer) whose own top-k experts equal the rollout's (1: no drift)
    "moe/replay_route_agreement",
)


@dataclass(frozen=True)
class RouterSettings:
    """``actor.moe`` as an engine reads it: the router losses' coefficients and routing replay."""

    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    routing_replay: bool = False


class RouterTerms:
    """The router losses, metrics and replay of one engine's model (module docstring)."""

    def __init__(self, model: nn.Module, settings: RouterSettings) -> None:
        self.settings = settings
        self.tap = RouterTap(model, keep_logits=True).__enter__()  # hooks for the engine's life
        self._mask: torch.Tensor | None = None

    def wrap(self, logprobs_fn: Callable[..., Any]) -> Callable[..., Any]:
        """``logprobs_fn`` that keeps the routers' logits of each call and replays routes where given."""

        def run(model: nn.Module, micro: Mapping[str, Any], *, layout: Any = None, **head: Any) -> Any:
            routes = micro.get("routed_experts") if self.settings.routing_replay else None
            plan = micro if layout is None else layout
            response_len = micro["responses"].shape[1]
            if routes is None:
                self.prepare(None, None)  # the layout decides the positions; metrics count every position
                return logprobs_fn(model, micro, layout=layout, **head)
            first, kept = padding_free_window(plan["attention_mask"], response_len)
            end = micro["input_ids"].shape[1] - (response_len - kept)
            window = routes[:, first:end]
            mask = micro["attention_mask"][:, first:end].reshape(-1).bool()
            self.prepare(window.reshape(-1, *window.shape[2:]), mask)
            return response_logprobs(model, micro, layout=layout, share_prompts=False, **head)

        return run

    def prepare(self, routes: torch.Tensor | None, mask: torch.Tensor | None) -> None:
        """Before a forward: forget the last one's logits, replay ``routes`` ``[N, L, k]`` (the forward's N
        positions in the order its routers see them; only with ``routing_replay``; None: the routers
        choose) and count the router terms over the positions ``mask`` ``[N]`` bool keeps (None: all)."""
        self.tap.clear()
        self.tap.replay(routes if self.settings.routing_replay else None)
        self._mask = mask

    def last_routes(self) -> torch.Tensor:
        """The experts of the last forward, ``[N, L, k]`` (N: its positions)."""
        return self.tap.routes()

    def loss_and_metrics(self, weight: float) -> tuple[torch.Tensor | float, dict[str, torch.Tensor]]:
        """The last forward's router term (``weight`` x the coefficients' sum of losses) and its metrics.

        ``weight``: the micro-batch's share of the mini-batch's response tokens. The metrics are
        detached scalars, means over the MoE layers (the load's worst layer as ``..._max``).
        """
        logits, experts = self.tap.logits, self.tap.experts
        if not logits:
            return 0.0, {}
        mask = self._mask
        if mask is not None and mask.shape[0] != logits[0].shape[0]:
            mask = None
        aux = torch.stack(
            [load_balancing_loss(z, e, mask) for z, e in zip(logits, experts, strict=True)]
        ).mean()
        zl = torch.stack([router_z_loss(z, mask) for z in logits]).mean()
        loads = []
        for z, e in zip(logits, experts, strict=True):
            counts = expert_load(e, z.shape[-1], mask)
            loads.append(counts.max() / counts.mean().clamp(min=1e-9))
        load = torch.stack(loads)
        metrics = {
            "moe/aux_loss": aux.detach(),
            "moe/z_loss": zl.detach(),
            "moe/router_entropy": torch.stack([router_entropy(z, mask) for z in logits]).mean(),
            "moe/expert_load_max_over_mean": load.mean(),
            "moe/expert_load_max_over_mean_max": load.max(),
        }
        if self.tap.agreement:
            same = torch.stack([a for a, _ in self.tap.agreement]).sum()
            replayed = torch.stack([n for _, n in self.tap.agreement]).sum()
            metrics["moe/replay_route_agreement"] = same / replayed.clamp(min=1)
        s = self.settings
        term: torch.Tensor | float = 0.0
        if s.aux_loss_coef > 0:
            term = term + weight * s.aux_loss_coef * aux
        if s.z_loss_coef > 0:
            term = term + weight * s.z_loss_coef * zl
        return term, metrics


def router_terms_for(model: nn.Module, settings: RouterSettings | None) -> RouterTerms | None:
    """:class:`RouterTerms` for a model with top-k routers; None for a dense model.

    ``ValueError`` when ``settings`` ask for a router term or replay on a dense model.
    """
    if not moe_routers(model):
        if settings is not None and settings != RouterSettings():
            raise ValueError(
                f"router settings {settings} need a mixture-of-experts model; this one has no routers"
            )
        return None
    return RouterTerms(model, settings or RouterSettings())
