"""How an FSDP2 role's model is sharded: ``fully_shard`` per decoder layer, then a root.

Shared by :class:`~verity.engines.fsdp2.FSDP2Engine` (the root is the whole model; optionally
the vocabulary kept in row shards outside it, :mod:`verity.engines.vocab_sharding`) and the
reward model (the root is the backbone; its head stays whole).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from verity.engines.hf_loading import decoder_layers
from verity.engines.vocab_sharding import shard_vocabulary

__all__ = ["ShardedModel", "shard_for_training", "shard_layers_and_root"]


def shard_layers_and_root(
    model: nn.Module,
    root: nn.Module,
    mesh: Any,
    *,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    ignored_params: set[nn.Parameter] | None = None,
) -> list[nn.Module]:
    """``fully_shard`` each of ``model``'s decoder layers, then ``root``; return the FSDP2 units.

    Each parameter becomes a ``DTensor`` holding this rank's dim-0 chunk; ``ignored_params``
    (inside ``root``) are left as they are.
    """
    options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    if offload_policy is not None:
        options["offload_policy"] = offload_policy
    for layer in decoder_layers(model):
        fully_shard(layer, **options)
    fully_shard(root, ignored_params=ignored_params or None, **options)
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@dataclass
class ShardedModel:
    """What :func:`shard_for_training` did to a model."""

    fsdp_modules: list[nn.Module] = field(default_factory=list)
    # the backward loss's scale that makes FSDP2's reduction a sum over the ranks (1: it sums already)
    loss_scale: float = 1.0
    vocab_sharded: bool = False  # the embedding and output layer kept in row shards


def shard_for_training(
    model: nn.Module,
    mesh: Any,
    *,
    mixed_precision: bool,
    reshard_after_forward: bool,
    offload_policy: OffloadPolicy,
    shard_vocab: bool,
) -> ShardedModel:
    """Shard a trained model over ``mesh`` with gradients summed (not averaged) over its ranks.

    ``mixed_precision``: bf16 gathers and compute, float32 gradient reduction. ``shard_vocab``:
    the vocabulary stays in row shards outside FSDP2's units. With FSDP2's sum reduction
    (``set_force_sum_reduction_for_comms``) the loss is not rescaled; an older torch
    averages, and ``loss_scale = W`` turns the mean back into a sum (``shard_vocab`` needs the
    sum reduction).
    """
    sum_api = hasattr(FSDPModule, "set_force_sum_reduction_for_comms")
    ignored: set[nn.Parameter] = set()
    if shard_vocab:
        if not sum_api:
            raise RuntimeError(
                "shard_vocab=True sums the vocabulary's gradients over the ranks and needs FSDP2's "
                "set_force_sum_reduction_for_comms (torch >= 2.8)"
            )
        ignored = shard_vocabulary(model, mesh, torch.bfloat16 if mixed_precision else None)
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision
        else MixedPrecisionPolicy()
    )
    units = shard_layers_and_root(
        model,
        model,
        mesh,
        reshard_after_forward=reshard_after_forward,
        mp_policy=policy,
        offload_policy=offload_policy,
        ignored_params=ignored,
    )
    result = ShardedModel(units, vocab_sharded=bool(ignored))
    if sum_api:
        for unit in units:
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
    else:
        result.loss_scale = float(mesh.size())
    return result
