"""Process groups and the collectives the Megatron engine runs itself.

The world is cut by ``megatron.core.parallel_state`` (order ``tp-cp-ep-dp-pp``):
tensor-parallel peers are consecutive ranks, then data-parallel replicas, then
pipeline stages; for a mixture-of-experts model, each run of ``EP`` consecutive
data-parallel ranks of a stage splits the experts (an expert-parallel group; the tokens'
all-to-all stays inside it, and inside a node: :mod:`verity.config.cluster_checks`). This module wraps those groups in :class:`ParallelLayout` and adds
the few collectives the engine needs beyond Megatron's layers, written with plain
``torch.distributed`` calls so that they run on gloo (CPU) and nccl (GPU) alike:

- :func:`gather_vocab_parallel`: all-gather of the TP vocabulary slices of the logits
  (autograd: the backward keeps this rank's slice, since every TP rank computes the
  same loss from the same gathered logits);
- point-to-point sends of activations and their gradients between pipeline stages;
- the data-parallel SUM of gradients, and the sum of tied-embedding gradients
  between the first and last pipeline stage;
- the global gradient norm over all TP/PP shards and experts, counting replicated parameters once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class ParallelLayout:
    """This rank's coordinates and groups (``None`` groups in a single process)."""

    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: Any
    pp_group: Any
    dp_group: Any
    mp_group: Any
    world_rank: int
    #: expert parallelism (MoE): ``ep`` consecutive data-parallel ranks split the experts; the
    #: ``dp / ep`` ranks holding the same experts (the expert data-parallel group) sum their gradients
    ep: int = 1
    ep_rank: int = 0
    ep_group: Any = None
    expert_dp_group: Any = None

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def pp_global_rank(self, stage: int) -> int:
        """World rank of pipeline stage ``stage`` with this rank's TP and DP coordinates."""
        return dist.get_global_rank(self.pp_group, stage) if self.pp_group is not None else self.world_rank


def initialize_layout(tp: int, pp: int, ep: int = 1) -> ParallelLayout:
    """Cut the default process group into TP x DP x PP with ``megatron.core.parallel_state``, and the
    data-parallel ranks of each stage into groups of ``ep`` consecutive ranks that split the experts.

    Re-cuts it if a different layout was initialised before in this process.
    """
    from megatron.core import parallel_state as ps

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "the megatron engine needs a torch.distributed process group (one rank is fine: "
            "init_process_group('gloo', store=HashStore(), rank=0, world_size=1))"
        )
    if ps.model_parallel_is_initialized():
        same = (
            ps.get_tensor_model_parallel_world_size() == tp
            and ps.get_pipeline_model_parallel_world_size() == pp
            and ps.get_expert_model_parallel_world_size() == ep
        )
        if not same:
            ps.destroy_model_parallel()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=1 if ep > 1 else None,
            create_gloo_process_groups=False,
        )
    return ParallelLayout(
        tp=tp,
        pp=pp,
        dp=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
        mp_group=ps.get_model_parallel_group(),
        world_rank=dist.get_rank(),
        ep=ep,
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_group=ps.get_expert_model_parallel_group(),
        expert_dp_group=ps.get_expert_data_parallel_group(),
    )


def model_parallel_nodes(layout: ParallelLayout) -> int:
    """Distinct nodes this rank's model-parallel group (TP x PP) spans, from each rank's ``NODE_RANK``;
    with expert parallelism, the most of that and of its expert-parallel group.

    1 means the groups' collectives stay on one node's fast links; more means every layer's
    tensor-parallel all-reduce (or token all-to-all) crosses the network, which the placement
    plan exists to avoid.
    """
    import os

    mine = os.environ.get("NODE_RANK", "0")
    groups = [layout.mp_group] + ([layout.ep_group] if layout.ep > 1 else [])
    spans = []
    for group in groups:
        seen: list[str | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(seen, mine, group=group)
        spans.append(len(set(seen)))
    return max(spans)


def comm_device(device: torch.device) -> torch.device:
    """Where small collective tensors live: the compute device under nccl, CPU under gloo."""
    return device if dist.get_backend() == "nccl" else torch.device("cpu")


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the last dimension over a group; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        world = dist.get_world_size(group)
        ctx.group, ctx.width = group, tensor.shape[-1]
        ctx.rank = dist.get_rank(group)
        parts = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad.narrow(-1, ctx.rank * ctx.width, ctx.width).contiguous(), None


def gather_vocab_parallel(logits: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    """``[..., V'/T]`` vocabulary slices of every TP rank joined to ``[..., V']`` (autograd-aware)."""
    if layout.tp == 1:
        return logits
    return _GatherLastDim.apply(logits, layout.tp_group)


def send_to(tensor: torch.Tensor, layout: ParallelLayout, stage: int) -> None:
    """Blocking send of ``tensor`` to pipeline stage ``stage`` (same TP and DP coordinates)."""
    dist.send(tensor.contiguous(), dst=layout.pp_global_rank(stage))


def recv_from(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, layout: ParallelLayout, stage: int
) -> torch.Tensor:
    """Blocking receive of a ``shape`` tensor from pipeline stage ``stage``."""
    out = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(out, src=layout.pp_global_rank(stage))
    return out


def all_reduce_gradients(params: list[torch.nn.Parameter], group: Any) -> None:
    """SUM the gradients of ``params`` over ``group`` in place, flattened into one buffer per dtype."""
    if group is None or dist.get_world_size(group) == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in same:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def sum_tied_embedding_gradients(
    embedding: torch.nn.Parameter | None, output: torch.nn.Parameter | None, layout: ParallelLayout
) -> None:
    """With tied embeddings under PP, add the first stage's embedding gradient and the last stage's
    output-layer gradient so that both copies take the same step (a no-op on middle stages)."""
    if layout.pp == 1:
        return
    first, last = layout.pp_global_rank(0), layout.pp_global_rank(layout.pp - 1)
    param = embedding if layout.is_first_stage else output if layout.is_last_stage else None
    if param is None:
        return
    grad = param.grad if param.grad is not None else torch.zeros_like(param)
    peer = last if layout.is_first_stage else first
    other = torch.empty_like(grad)
    # the lower rank sends first so that two blocking calls never wait on each other
    if layout.world_rank < peer:
        dist.send(grad.contiguous(), dst=peer)
        dist.recv(other, src=peer)
    else:
        dist.recv(other, src=peer)
        dist.send(grad.contiguous(), dst=peer)
    param.grad = grad + other if layout.is_first_stage else other + grad


def global_grad_norm(
    counted: list[torch.Tensor],
    layout: ParallelLayout,
    device: torch.device,
    experts: list[torch.Tensor] | None = None,
) -> float:
    """L2 norm of the whole model's gradient from this rank's share ``counted``.

    ``counted`` must hold each gradient element of the model exactly once over the
    model-parallel group (TP-split tensors on every TP rank, replicated ones on TP rank
    0 only, a tied duplicate on one stage only); the squares are summed over that group.
    ``experts`` are this rank's experts' gradients, whose squares are first summed over the
    expert-parallel group (each EP rank holds other experts). Data-parallel replicas hold
    identical gradients and are not summed.
    """
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g in counted:
        total += g.detach().double().pow(2).sum()
    total = total.to(comm_device(device))
    if experts is not None:
        expert_total = torch.zeros((), dtype=torch.float64, device=device)
        for g in experts:
            expert_total += g.detach().double().pow(2).sum()
        expert_total = expert_total.to(comm_device(device))
        if layout.ep > 1:
            dist.all_reduce(expert_total, group=layout.ep_group)
        total = total + expert_total
    if layout.mp_group is not None and dist.get_world_size(layout.mp_group) > 1:
        dist.all_reduce(total, group=layout.mp_group)
    return float(total.sqrt())


def broadcast_from_last_stage(obj: Any, layout: ParallelLayout) -> Any:
    """Any picklable object of the last pipeline stage, on every stage."""
    if layout.pp == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=layout.pp_global_rank(layout.pp - 1), group=layout.pp_group)
    return box[0]


def all_reduce_floats(values: list[float], group: Any, device: torch.device, op: str = "sum") -> list[float]:
    """SUM (or MAX) a list of floats over ``group``; the list itself when the group has one rank."""
    if group is None or dist.get_world_size(group) == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=comm_device(device))
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
    return t.tolist()
