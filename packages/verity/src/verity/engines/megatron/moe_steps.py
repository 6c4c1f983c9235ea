"""What a training or log-prob pass must do differently when experts are split over ranks.

Two rules follow from the token all-to-all (:mod:`.moe_dispatch`), which every rank of an
expert-parallel (EP) group enters once per MoE layer, micro-batch and direction:

- **every EP rank runs the same number of micro-batches.** Data-parallel ranks may hold
  different numbers of rows (a skipped zero-advantage row, a rank with padding only),
  hence different micro-batch counts; a rank short of micro-batches runs spare ones, the
  first row of its batch again, whose results are dropped and whose loss is
  ``0 * logits.sum()`` (connected to the graph, so its backward enters the same
  all-to-alls, and adds exactly zero to every gradient);
- **expert gradients are summed over the expert data-parallel group**, the ``dp / EP``
  ranks that hold the same experts; every other parameter over the whole data-parallel
  group as before. An expert's gradient on its rank already holds every EP peer's tokens'
  share (their activations came to it through the all-to-all).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from verity.engines.megatron.parallel import ParallelLayout, comm_device
from verity.engines.micro_batches import model_inputs, take_rows

#: the name part every routed expert's parameter has in Megatron's MoE layer
EXPERT_NAME = ".mlp.experts."


def is_expert(layout: Any) -> bool:
    """Whether a :class:`~verity.engines.megatron.convert.ParamLayout` is one routed expert's weight."""
    return layout.kind == "expert"


def split_expert_params(
    model: nn.Module, params: list[nn.Parameter]
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``params`` cut into (every other parameter, routed experts' parameters), each in the given order."""
    expert_ids = {id(p) for name, p in model.named_parameters() if EXPERT_NAME in f".{name}"}
    dense = [p for p in params if id(p) not in expert_ids]
    experts = [p for p in params if id(p) in expert_ids]
    return dense, experts


def even_micro_batches(
    inputs: list[dict[str, torch.Tensor]],
    last_fn: Callable[[int, torch.Tensor], tuple[Any, Any]],
    spare: Any,
    layout: ParallelLayout,
    device: torch.device,
    backward: bool,
) -> tuple[list[dict[str, torch.Tensor]], Callable[[int, torch.Tensor], tuple[Any, Any]]]:
    """Pad this rank's micro-batch inputs to the EP group's largest count (see the module docstring).

    Args:
        inputs: this rank's micro-batches' model inputs (``input_ids`` ... ``[b, S]``).
        last_fn: the last stage's function for a real micro-batch.
        spare: the batch the spare micro-batch's one row comes from (its first row).
        backward: whether the pass trains (a spare's loss is then ``0 * logits.sum()``).

    Returns:
        the padded inputs and a ``last_fn`` that answers spare micro-batches itself; the
        schedule's results for spares are ``None`` and must be dropped (:func:`real_results`).
    """
    count = torch.tensor([float(len(inputs))], dtype=torch.float64, device=comm_device(device))
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=layout.ep_group)
    wanted, real = int(count.item()), len(inputs)
    if wanted == real:
        return inputs, last_fn
    extra = model_inputs(take_rows(spare, 0, 1, device))
    padded = inputs + [extra] * (wanted - real)

    def padded_fn(index: int, logits: torch.Tensor) -> tuple[Any, Any]:
        if index < real:
            return last_fn(index, logits)
        return (logits.sum() * 0.0 if backward else None), SPARE

    return padded, padded_fn


class _Spare:
    """The result of a spare micro-batch (dropped by :func:`real_results`)."""


SPARE = _Spare()


def real_results(results: list[Any]) -> list[Any]:
    """The schedule's results without those of spare micro-batches."""
    return [r for r in results if r is not SPARE]
