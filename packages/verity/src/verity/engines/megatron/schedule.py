"""The micro-batch schedule: GPipe-style all forwards, then all backwards, over pipeline stages.

For micro-batches ``m = 0 .. M-1`` every stage ``p`` of ``P`` runs::

    forward phase:   x_m = recv(p-1) if p > 0            (activations [S, b, H])
                     y_m = stage_p(x_m)
                     send(y_m, p+1) if p < P-1, else loss_m = last_stage_fn(m, y_m)
    backward phase:  g_m = recv(p+1) if p < P-1           (gradient of y_m)
                     backward(loss_m) on the last stage, else backward(y_m, g_m)
                     send(grad of x_m, p-1) if p > 0

Blocking point-to-point sends in this order cannot deadlock: every send of stage
``p`` is matched by the next receive of stage ``p +- 1`` in the same order. All
activations of the ``M`` micro-batches are kept until the backward phase (GPipe);
stages overlap only through the blocking hand-offs (no interleaving, no 1F1B).
Megatron's own schedules (``get_forward_backward_func``) are not used: they assume
CUDA tensors and its distributed optimizer wrapper. With one stage this is the
plain micro-batch loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from verity.engines.megatron.model import stage_forward
from verity.engines.megatron.parallel import ParallelLayout, recv_from, send_to

#: ``last_stage_fn(index, logits_slice) -> (loss or None, result)``; logits are this TP rank's vocab slice
LastStageFn = Callable[[int, torch.Tensor], tuple[torch.Tensor | None, Any]]


def run_micro_batches(
    model: nn.Module,
    layout: ParallelLayout,
    micro_inputs: list[dict[str, torch.Tensor]],
    inv_freq: torch.Tensor,
    last_stage_fn: LastStageFn,
    *,
    keep_last: int,
    hidden_size: int,
    dtype: torch.dtype,
    backward: bool,
    before_forward: Callable[[dict[str, torch.Tensor]], None] | None = None,
) -> list[Any]:
    """Run every micro-batch through this rank's stage (and backward when ``backward``).

    Args:
        micro_inputs: per micro-batch ``input_ids``, ``attention_mask``, ``position_ids``
            ``[b, S]`` on the compute device (the same rows on every stage).
        last_stage_fn: called on the last stage with each micro-batch's logits slice
            ``[keep_last, b, V'/T]``; returns the loss to back-propagate (or ``None``)
            and a result kept for the caller.
        keep_last: sequence positions the output layer is applied to (the last ones).
        backward: run the backward phase (gradients accumulate into ``.grad``).
        before_forward: called with each micro-batch's inputs just before its forward (an MoE
            model's routes and real positions: :func:`.moe_routing.prepare_forward`).

    Returns:
        the ``last_stage_fn`` results in micro-batch order on the last stage; ``[]`` elsewhere.
    """
    stage = layout.pp_rank
    first, last = layout.is_first_stage, layout.is_last_stage
    device = inv_freq.device
    saved: list[tuple[torch.Tensor | None, torch.Tensor]] = []
    results: list[Any] = []
    for index, inputs in enumerate(micro_inputs):
        hidden_in = None
        if not first:
            b, s = inputs["input_ids"].shape
            hidden_in = recv_from((s, b, hidden_size), dtype, device, layout, stage - 1)
            if backward:
                hidden_in.requires_grad_(True)
        if before_forward is not None:
            before_forward(inputs)
        out = stage_forward(model, inputs, hidden_in, inv_freq, keep_last=keep_last if last else None)
        if last:
            loss, result = last_stage_fn(index, out)
            results.append(result)
            if backward:
                if loss is None:
                    raise ValueError("last_stage_fn must return a loss when backward=True")
                saved.append((hidden_in, loss))
        else:
            send_to(out.detach(), layout, stage + 1)
            if backward:
                saved.append((hidden_in, out))
    if backward:
        for hidden_in, out in saved:
            if last:
                out.backward()
            else:
                grad = recv_from(tuple(out.shape), out.dtype, device, layout, stage + 1)
                torch.autograd.backward(out, grad)
            if not first:
                assert hidden_in is not None
                grad_in = hidden_in.grad if hidden_in.grad is not None else torch.zeros_like(hidden_in)
                send_to(grad_in, layout, stage - 1)
    return results
