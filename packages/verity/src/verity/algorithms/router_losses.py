r"""Router terms and statistics of a mixture-of-experts layer, from its router logits and chosen experts.

For one MoE layer with :math:`E` experts, top-:math:`k` routing and :math:`N` real tokens (padding
left out by ``mask``), router logits :math:`z \in \mathbb{R}^{N \times E}` and probabilities
:math:`p = \mathrm{softmax}(z)`:

* load-balancing loss (Switch Transformer form): :math:`E \sum_e f_e P_e` with
  :math:`f_e` the share of the :math:`N k` expert assignments that went to expert :math:`e` (a
  constant) and :math:`P_e = \frac1N \sum_t p_{t,e}` the mean router probability (with a gradient).
  It is 1 when both are uniform and grows as the router concentrates tokens on few experts;
* router z-loss (ST-MoE): :math:`\frac1N \sum_t (\log \sum_e e^{z_{t,e}})^2`, which keeps the logits
  small so that the softmax stays numerically tame;
* expert load: tokens routed to each expert, and its max over experts divided by its mean
  (1 = perfectly balanced, :math:`E/k` = every token on the same :math:`k` experts);
* router entropy: the mean over tokens of :math:`-\sum_e p_{t,e} \log p_{t,e}` (nats; at most
  :math:`\log E`).
"""

from __future__ import annotations

import torch

__all__ = ["expert_load", "load_balancing_loss", "router_entropy", "router_z_loss"]


def _real(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``[N, E]`` float32 logits of the real tokens (``mask`` ``[N]`` bool; None: all)."""
    logits = logits.float()
    return logits if mask is None else logits[mask.to(logits.device, torch.bool)]


def expert_load(chosen: torch.Tensor, num_experts: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Tokens routed to each expert: ``[E]`` float32 counts from ``chosen`` ``[N, k]`` expert ids."""
    if mask is not None:
        chosen = chosen[mask.to(chosen.device, torch.bool)]
    counts = torch.zeros(num_experts, dtype=torch.float32, device=chosen.device)
    return counts.index_add_(0, chosen.reshape(-1).long(), torch.ones(chosen.numel(), device=chosen.device))


def load_balancing_loss(
    logits: torch.Tensor, chosen: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``E * sum_e f_e * P_e`` (module docstring) from ``logits`` ``[N, E]`` and ``chosen`` ``[N, k]``; a scalar
    with a gradient through the probabilities only (0 when no token is real)."""
    real = _real(logits, mask)
    if real.shape[0] == 0:
        return logits.sum() * 0.0
    num_experts = real.shape[-1]
    counts = expert_load(chosen, num_experts, mask).to(real.device)
    share = counts / counts.sum().clamp(min=1.0)
    mean_prob = torch.softmax(real, dim=-1).mean(dim=0)
    return num_experts * (share * mean_prob).sum()


def router_z_loss(logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The mean over real tokens of ``logsumexp(logits)^2`` (``logits`` ``[N, E]``); a scalar with a gradient."""
    real = _real(logits, mask)
    if real.shape[0] == 0:
        return logits.sum() * 0.0
    return torch.logsumexp(real, dim=-1).square().mean()


def router_entropy(logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The mean over real tokens of the router distribution's entropy, nats (``logits`` ``[N, E]``; detached)."""
    real = _real(logits.detach(), mask)
    if real.shape[0] == 0:
        return torch.zeros((), device=logits.device)
    logp = torch.log_softmax(real, dim=-1)
    return -(logp.exp() * logp).sum(-1).mean()
