"""``actor.moe``: the settings of a mixture-of-experts policy (router losses, rollout routing replay).

The section is read by the training engines that train an MoE model (the FSDP2 engine on the
HF path; the Megatron-core engine on one pipeline stage, through the same router code). On a
dense model every key must stay at its default: :mod:`verity.config.moe_checks` refuses them before any worker starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from verity.config.fields import AtLeast

__all__ = ["MoEConfig"]


@dataclass
class MoEConfig:
    """Router losses and rollout routing replay of an MoE policy (docs/algorithms.md, "Mixture of experts")."""

    # load-balancing loss added to the actor's loss: coef * E * sum_e f_e * P_e per MoE layer, averaged
    # over layers (verity's own term: the model config's router_aux_loss_coef is not read)
    aux_loss_coef: Annotated[float, AtLeast(0, "0: no load-balancing term")] = 0.0
    # router z-loss added to the actor's loss: coef * mean over tokens of logsumexp(router logits)^2
    z_loss_coef: Annotated[float, AtLeast(0, "0: no z-loss term")] = 0.0
    # rollout routing replay: the rollout records each token's top-k experts per MoE layer and the
    # trainer's forwards (old log-probs and the update) use those experts; the gate weights still come
    # from the trainer's router (docs/algorithms.md, "Mixture of experts"); needs rollout.engine=hf
    routing_replay: bool = False

    @property
    def router_loss(self) -> bool:
        """Whether a router term joins the actor's loss."""
        return self.aux_loss_coef > 0 or self.z_loss_coef > 0
