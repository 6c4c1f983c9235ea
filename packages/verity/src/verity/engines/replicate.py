"""Replicated data parallelism: a full copy of the model per rank, gradients summed once per step.

FSDP shards every parameter over the ranks, so each decoder layer costs an all-gather in
forward (another in backward with ``reshard_after_forward``) and a reduce-scatter of its
gradient: three collectives per layer per micro-batch. For a model whose weights are a
few megabytes those collectives cost more than the memory they save — on two CPU
processes over gloo they doubled the quickstart's update (``fsdp2.sharding`` in
``docs/engines.md``). Replicated, each rank runs its micro-batches on its own copy and
the ranks meet once per optimizer step, in :func:`all_reduce_gradients`: every gradient
flattened into one buffer per dtype, one ``all_reduce(SUM)``, copied back. The sum (not
the mean) follows the engines' gradient contract: micro-batch losses are already
normalised by counts over the whole mini-batch.

Every rank then takes the same AdamW step on the same summed gradient, so the copies
stay identical (the same float operations in the same order on every rank).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

__all__ = ["SHARDING_MODES", "all_reduce_gradients"]

SHARDING_MODES = ("full", "replicate")
"""``fsdp2.sharding``: ``full`` (FSDP: parameters, gradients and optimizer state sharded) or ``replicate``."""


def all_reduce_gradients(
    parameters: Iterable[torch.nn.Parameter], group: dist.ProcessGroup | None = None
) -> int:
    """Sum every parameter's ``.grad`` over the ranks of ``group`` in one collective per dtype.

    A parameter without a gradient on this rank contributes zeros, so every rank flattens
    the same parameters in the same order; one that has none on any rank keeps ``None``
    (as under FSDP, the optimizer then skips it). Returns the bytes reduced. Nothing
    happens (0) outside a process group or on a single rank.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return 0
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
    for p in parameters:
        if p.requires_grad:
            by_kind.setdefault((p.dtype, p.device), []).append(p)
    reduced = 0
    for params in by_kind.values():
        # the gradients, then one "has a gradient" count per parameter
        pieces = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
        present = torch.tensor([float(p.grad is not None) for p in params], dtype=params[0].dtype)
        flat = torch.cat([*pieces, present.to(params[0].device)])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        reduced += flat.numel() * flat.element_size()
        counts = flat[-len(params) :].tolist()
        offset = 0
        for p, count in zip(params, counts, strict=True):
            n = p.numel()
            if count > 0:
                chunk = flat[offset : offset + n].view_as(p)
                if p.grad is None:
                    p.grad = chunk.clone()
                else:
                    p.grad.copy_(chunk)
            offset += n
    return reduced
