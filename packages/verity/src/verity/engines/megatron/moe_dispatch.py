"""Megatron-core's all-to-all token dispatcher, made to run on host CPUs over gloo as well as on GPUs.

An MoE layer sends each token to the expert-parallel (EP) ranks that hold its top-k
experts and brings the experts' outputs back: two variable-size all-to-alls per layer
and direction (``all_to_all_single`` with per-rank split sizes). Megatron-core 0.16's
``MoEAlltoAllTokenDispatcher`` does exactly this, but assumes CUDA in four places
(and its ``TopKRouter`` moves a host gate weight to CUDA; :class:`HostTopKRouter` does not):
it opens a CUDA stream in its constructor, copies the split sizes to the host on that
stream, and allocates the receive buffer on ``torch.cuda.current_device()``.

:class:`HostAlltoAllDispatcher` keeps Megatron's dispatcher (its permutation, its
split arithmetic, its autograd) and replaces only those three on a host device:

- the constructor runs with a stand-in for the class's CUDA stream;
- the per-expert token counts are exchanged with a plain ``all_gather`` (Megatron's
  gathers into a CUDA buffer);
- the split sizes are read on the host directly (they already live there);
- :func:`all_to_all_tokens` allocates on the input's device and, over gloo, adds
  one spare row to every split, so that no split is ever empty: a rank whose tokens
  all went to the other rank's experts (or which received none) still exchanges one
  row with every peer. Empty gloo splits corrupted the heap under load (the same
  guard as :mod:`verity.resharding.tp_reshard`). The spare rows are zeros and are
  dropped on arrival; gradients flow through the same exchange reversed.

On a CUDA device every override steps aside and Megatron's own code runs.

:class:`HostMoELayer` is Megatron's ``MoELayer`` with this dispatcher in its
``token_dispatcher`` slot; :func:`verity.engines.megatron.moe_model.use_moe_layer`
puts it and :class:`HostTopKRouter` in the layer spec.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from verity.engines.megatron.moe_routing import ReplayableTopKRouter, routing_map


def _as_sizes(splits: Any) -> list[int] | None:
    """Split sizes as a list of ints (Megatron keeps them as tensors or numpy arrays)."""
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        return [int(s) for s in splits.tolist()]
    return [int(s) for s in splits]


def _exchange(tensor: torch.Tensor, out_sizes: list[int], in_sizes: list[int], group: Any) -> torch.Tensor:
    """One ``all_to_all_single`` of the rows of ``tensor`` ``[N, ...]``: ``in_sizes[r]`` rows go to rank
    ``r``, ``out_sizes[r]`` rows come from it; over gloo with one zero spare row per split (see the module)."""
    tensor = tensor.contiguous()
    tail = tuple(tensor.shape[1:])
    if dist.get_backend(group) != "gloo":
        out = tensor.new_empty((sum(out_sizes), *tail))
        dist.all_to_all_single(out, tensor, out_sizes, in_sizes, group=group)
        return out
    spare = tensor.new_zeros((1, *tail))
    pieces: list[torch.Tensor] = []
    for part in torch.split(tensor, in_sizes):
        pieces.extend((part, spare))
    send = torch.cat(pieces)
    recv = tensor.new_empty((sum(out_sizes) + len(out_sizes), *tail))
    dist.all_to_all_single(recv, send, [n + 1 for n in out_sizes], [n + 1 for n in in_sizes], group=group)
    kept = [part[:-1] for part in torch.split(recv, [n + 1 for n in out_sizes])]
    return torch.cat(kept) if kept else recv[:0]


class _AllToAllTokens(torch.autograd.Function):
    """Rows exchanged over an EP group; the backward exchanges their gradients the other way."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, out_sizes: list[int], in_sizes: list[int], group: Any):  # type: ignore[override]
        ctx.sizes, ctx.group = (out_sizes, in_sizes), group
        return _exchange(tensor, out_sizes, in_sizes, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        out_sizes, in_sizes = ctx.sizes
        return _exchange(grad, in_sizes, out_sizes, ctx.group), None, None, None


def all_to_all_tokens(
    tensor: torch.Tensor, out_sizes: Sequence[int] | None, in_sizes: Sequence[int] | None, group: Any
) -> torch.Tensor:
    """Exchange the rows of ``tensor [N, ...]`` over ``group`` (autograd-aware, gloo or nccl).

    Args:
        tensor: this rank's rows, grouped by destination rank in rank order.
        out_sizes: rows received from each rank (``None``: equal splits).
        in_sizes: rows sent to each rank, summing to ``N`` (``None``: equal splits).

    Returns:
        ``[sum(out_sizes), ...]`` rows, grouped by source rank, on ``tensor``'s device.
    """
    world = dist.get_world_size(group)
    if world == 1:
        return tensor
    n = tensor.shape[0]
    ins = _as_sizes(in_sizes) or [n // world] * world
    outs = _as_sizes(out_sizes) or [n // world] * world
    return _AllToAllTokens.apply(tensor, outs, ins, group)


class _NoStream:
    """Stands in for the CUDA stream Megatron's dispatcher opens in its constructor (never used on a host)."""


@contextlib.contextmanager
def _without_cuda_stream() -> Iterator[None]:
    """Let Megatron's all-to-all dispatcher be constructed where there is no CUDA device."""
    cls = MoEAlltoAllTokenDispatcher
    if torch.cuda.is_available() or cls.cuda_dtoh_stream is not None:
        yield
        return
    cls.cuda_dtoh_stream = _NoStream()  # type: ignore[assignment]
    try:
        yield
    finally:
        cls.cuda_dtoh_stream = None


class HostAlltoAllDispatcher(MoEAlltoAllTokenDispatcher):
    """Megatron's all-to-all dispatcher that also runs on host CPUs over gloo (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with _without_cuda_stream():
            super().__init__(*args, **kwargs)

    def preprocess(self, routing_map: torch.Tensor) -> torch.Tensor:
        """Split sizes of the all-to-all from the routing map ``[tokens, E]`` (bool); returns the tokens
        each local expert will receive. Megatron's arithmetic; on a host its count exchange is a plain
        ``all_gather`` (Megatron's allocates on CUDA)."""
        if routing_map.is_cuda or (self.ep_size == 1 and self.tp_size == 1) or self.drop_and_pad:
            return super().preprocess(routing_map)
        counts = routing_map.sum(dim=0).long()  # [E]: this rank's tokens for each expert
        self.num_out_tokens = routing_map.size(0) * self.config.moe_router_topk
        self.input_splits = counts.reshape(self.ep_size, self.num_local_experts).sum(dim=1)
        gathered = [torch.empty_like(counts) for _ in range(self.ep_size * self.tp_size)]
        dist.all_gather(gathered, counts, group=self.tp_ep_group)
        per_expert = (
            torch.stack(gathered).reshape(self.ep_size, self.tp_size, self.num_experts).transpose(0, 1)
        )
        first, last = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        mine = per_expert[:, :, first:last].contiguous()  # [TP, EP, local experts]: tokens from each rank
        per_rank = mine.sum(dim=2)
        self.output_splits = per_rank[self.tp_rank]
        self.output_splits_tp = per_rank.sum(dim=1)
        if self.num_local_experts > 1:
            self.num_global_tokens_per_local_expert = mine.view(-1, self.num_local_experts)
        return mine.sum(dim=(0, 1))

    def _maybe_dtoh_and_synchronize(
        self, point: str, tokens_per_expert: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Megatron's device-to-host copy of the split sizes on its CUDA stream; on a host they are there."""
        on_device = tokens_per_expert is not None and tokens_per_expert.is_cuda
        splits_on_device = isinstance(self.input_splits, torch.Tensor) and self.input_splits.is_cuda
        if on_device or splits_on_device:
            return super()._maybe_dtoh_and_synchronize(point, tokens_per_expert)
        return tokens_per_expert  # type: ignore[return-value]

    def token_dispatch(self, permutated_local_input_tokens: torch.Tensor, permuted_probs: torch.Tensor):
        """Send each token (and its routing weight) to the EP rank of its expert."""
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize(
            "before_ep_alltoall", self.tokens_per_expert
        )
        tokens = all_to_all_tokens(
            permutated_local_input_tokens, self.output_splits, self.input_splits, self.ep_group
        )
        probs = all_to_all_tokens(permuted_probs, self.output_splits, self.input_splits, self.ep_group)
        return tokens, probs

    def token_combine(
        self, hidden_states: torch.Tensor, async_finish: bool = True, allocate_on_comm_stream: bool = True
    ):
        """Bring each expert output back to the EP rank its token came from."""
        return all_to_all_tokens(hidden_states, self.input_splits, self.output_splits, self.ep_group)


_ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


class HostTopKRouter(TopKRouter):
    """Megatron's top-k router, whose gate stays where the model is (Megatron's moves a host weight to CUDA,
    and its gating function needs Transformer Engine's GEMM); on a host a plain ``linear`` in the router dtype.

    Its top-k choice is a :class:`~verity.engines.megatron.moe_routing.ReplayableTopKRouter` child
    (``choice``), HF's router interface, which the shared router code reads and replays.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.choice = ReplayableTopKRouter(
            self.config.num_moe_experts, self.topk, norm_topk_prob=not self.config.moe_router_pre_softmax
        )

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        """``(probs [N, E], routing_map [N, E] bool)`` from logits ``[..., E]`` through ``choice`` (softmax
        top-k as HF's router; no aux loss, no capacity: see :mod:`.moe_model`)."""
        flat = logits.reshape(-1, logits.shape[-1])
        flat, weights, experts = self.choice(flat)
        return routing_map(flat, weights, experts)

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        """Router logits ``[tokens, E]`` in the router dtype from hidden states ``[..., H]``."""
        if input.is_cuda:
            return super().gating(input)
        dtype = _ROUTER_DTYPES.get(self.config.moe_router_dtype, input.dtype)
        bias = self.bias.to(dtype) if self.bias is not None else None
        logits = torch.nn.functional.linear(input.to(dtype), self.weight.to(dtype), bias)
        return logits.reshape(-1, logits.shape[-1])


class HostMoELayer(MoELayer):
    """Megatron's ``MoELayer`` whose token dispatcher is :class:`HostAlltoAllDispatcher`."""

    def __init__(
        self, config: Any, submodules: Any = None, layer_number: int | None = None, pg_collection: Any = None
    ):
        if config.moe_token_dispatcher_type != "alltoall":
            raise ValueError(f"HostMoELayer dispatches all-to-all, got {config.moe_token_dispatcher_type!r}")
        pg_collection = pg_collection if pg_collection is not None else get_default_pg_collection()
        with _without_cuda_stream():
            super().__init__(
                config, submodules=submodules, layer_number=layer_number, pg_collection=pg_collection
            )
        self.token_dispatcher = HostAlltoAllDispatcher(
            self.num_local_experts, self.local_expert_indices, config=self.config, pg_collection=pg_collection
        )
