"""The routers of an HF mixture-of-experts model: read each token's experts, or make it use given ones.

HF's Qwen2-MoE and Qwen3-MoE layers route through a ``*TopKRouter`` module (``mlp.gate``) that
maps the layer's ``[N, H]`` hidden states (N = the forward's positions, batch and time flattened)
to ``(logits [N, E], weights [N, k], experts [N, k])``. A :class:`RouterTap` puts a forward hook on
every such router for the span of a ``with`` block:

* it keeps each layer's logits (with their gradient, for the router losses) and chosen experts;
* with :meth:`RouterTap.replay` set, it replaces each layer's choice by the given experts and
  recomputes their weights from the *current* logits (softmax over all experts, the chosen ones
  gathered, renormalised when the router does), so the output is differentiable in the router's
  weights exactly as HF's own routing is: rollout routing replay fixes which experts run, the
  router still learns through the weights and the router losses.

The rollout records with it (:mod:`verity.rollout.hf_rollout`) and the training engines replay and
measure with it (:mod:`verity.engines.fsdp2`; the Megatron engine through its router's top-k child,
:mod:`verity.engines.megatron.moe_routing`), so both sides read routers the same way.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["ROUTES_KEY", "RouteRecorder", "RouterTap", "moe_routers"]

#: the rollout batch's ``[B, P+R, L, k]`` experts per column and MoE layer (-1: none recorded)
ROUTES_KEY = "routed_experts"


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The model's top-k routers in layer order (empty for a dense model)."""
    return [
        m
        for m in model.modules()
        if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k") and hasattr(m, "num_experts")
    ]


class RouterTap:
    """Forward hooks on every router of ``model`` while the ``with`` block runs (module docstring).

    After a forward, :attr:`logits` holds one ``[N, E]`` tensor per MoE layer (kept only with
    ``keep_logits``) and :attr:`experts` one ``[N, k]`` int64 tensor per layer, in layer order; a
    replayed forward also counts, per layer, the positions where the router's own top-k set equals
    the replayed one (:attr:`agreement`). :meth:`clear` empties them before the next forward.
    """

    def __init__(self, model: nn.Module, *, keep_logits: bool = False) -> None:
        self.routers = moe_routers(model)
        self.keep_logits = keep_logits
        self.logits: list[torch.Tensor] = []
        self.experts: list[torch.Tensor] = []
        # per replayed layer: (positions whose own top-k set equals the replayed one, positions replayed)
        self.agreement: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._replay: torch.Tensor | None = None
        self._handles: list[Any] = []

    @property
    def num_layers(self) -> int:
        """MoE layers of the model (routers found)."""
        return len(self.routers)

    @property
    def top_k(self) -> int:
        """Experts per token (the first router's ``top_k``; 0 for a dense model)."""
        return int(self.routers[0].top_k) if self.routers else 0

    @property
    def num_experts(self) -> int:
        """Routed experts per layer (0 for a dense model)."""
        return int(self.routers[0].num_experts) if self.routers else 0

    def replay(self, experts: torch.Tensor | None) -> None:
        """Use ``experts`` ``[N, L, k]`` (the next forward's N positions, L MoE layers) instead of the routers'
        own choice, except at positions holding -1; None: the routers choose."""
        if experts is not None and (experts.dim() != 3 or experts.shape[1:] != (self.num_layers, self.top_k)):
            raise ValueError(
                f"replayed experts must be [N, {self.num_layers}, {self.top_k}], got {list(experts.shape)}"
            )
        self._replay = experts

    def clear(self) -> None:
        """Forget the last forward's logits, experts and agreement counts."""
        self.logits, self.experts, self.agreement = [], [], []

    def routes(self) -> torch.Tensor:
        """The last forward's experts as ``[N, L, k]`` int64 (layers stacked in order)."""
        return torch.stack(self.experts[-self.num_layers :], dim=1)

    def __enter__(self) -> RouterTap:
        for layer, router in enumerate(self.routers):
            self._handles.append(router.register_forward_hook(self._hook(layer)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, layer: int):
        def hook(router: nn.Module, args: Any, output: Any) -> Any:
            logits, weights, experts = output
            if self._replay is not None:
                given = self._replay[:, layer].to(logits.device, torch.long)
                if given.shape[0] != logits.shape[0]:
                    raise ValueError(
                        f"replayed experts cover {given.shape[0]} positions, the forward has {logits.shape[0]}"
                    )
                # -1: nothing recorded at that position (padding, the last sampled token): the router's own
                recorded = given[:, :1] >= 0
                same = (given.sort(-1).values == experts.sort(-1).values).all(-1, keepdim=True)
                self.agreement.append((same[recorded].float().sum(), recorded.sum()))
                experts = torch.where(recorded, given, experts)
                probs = torch.softmax(logits, dtype=torch.float32, dim=-1)
                weights = probs.gather(1, experts)
                if getattr(router, "norm_topk_prob", False):
                    weights = weights / weights.sum(dim=-1, keepdim=True)
                weights = weights.to(logits.dtype)
            if self.keep_logits:
                self.logits.append(logits)
            self.experts.append(experts.detach())
            return logits, weights, experts

        return hook


class RouteRecorder:
    """The experts a decode loop's forwards chose, per row and column of ``input_ids``: ``[B, P+R, L, k]``.

    The table is int16 (expert ids), ``-1`` where nothing was recorded: prompt padding, response
    columns after a row finished and the last sampled token (sampled, never fed back). A replayed
    forward lets the router choose at ``-1`` (:class:`RouterTap`). Memory: ``B x (P+R) x L x k x 2``
    bytes (a 48-layer top-8 model: 768 bytes per token).
    """

    def __init__(self, model: nn.Module, rows: int, prompt_len: int, new_tokens: int) -> None:
        self.tap = RouterTap(model)
        self.prompt_len = prompt_len
        shape = (rows, prompt_len + new_tokens, self.tap.num_layers, self.tap.top_k)
        self.table = torch.full(shape, -1, dtype=torch.int16)

    def prefill(self, inverse: torch.Tensor | None = None) -> None:
        """Record the prompt forward's routes (``inverse``: row -> computed row, when rows shared a prompt)."""
        routes = self.tap.routes().cpu()
        computed = routes.reshape(-1, self.prompt_len, *routes.shape[1:])
        self.table[:, : self.prompt_len] = computed if inverse is None else computed[inverse.cpu()]
        self.tap.clear()

    def step(self, batch_rows: torch.Tensor, step: int) -> None:
        """Record the routes of response token ``step`` fed for the rows ``batch_rows`` (one position each)."""
        self.table[batch_rows.cpu(), self.prompt_len + step] = self.tap.routes().cpu().to(torch.int16)
        self.tap.clear()

    def routes(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """The table with ``-1`` wherever ``attention_mask`` ``[B, P+R]`` is 0 (padding never replays)."""
        table = self.table.clone()
        table[~attention_mask.cpu().bool()] = -1
        return table
